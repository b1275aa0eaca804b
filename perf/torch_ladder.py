"""PyTorch on phos: a ladder of steps, each printing a fingerprint of its results.

Run it natively and through phos (LD_LIBRARY_PATH=phos/stub, PHOS_SERVER=...) with the same
arguments; compare the two JSON files with --compare. Every step is deterministic (seeded,
deterministic algorithms where PyTorch offers them), so equal results mean equal digests.

    python3 perf/torch_ladder.py --json native.json
    LD_LIBRARY_PATH=phos/stub python3 perf/torch_ladder.py --json phos.json
    python3 perf/torch_ladder.py --compare native.json phos.json
"""
import argparse
import hashlib
import json
import os
import sys
import time
import traceback


def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def seeded(torch):
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)


def step_tensors(torch):
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    y = (x * 2 + 1).sin() / (x.cos() + 3)
    return {"digest": digest(y), "sum": float(y.sum())}


def step_matmul(torch):
    seeded(torch)
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    c32 = a @ b
    c16 = a.bfloat16() @ b.bfloat16()
    return {"fp32": digest(c32), "bf16": digest(c16)}


def step_conv(torch):
    seeded(torch)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    x = torch.randn(8, 16, 32, 32, device="cuda", requires_grad=True)
    y = conv(x)
    y.square().mean().backward()
    return {"forward": digest(y), "grad_input": digest(x.grad), "grad_weight": digest(conv.weight.grad)}


def train(torch, model, batch, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        x, target = batch()
        loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if SAY_STEPS:          # perf/torch_recovery.py acts at a given step
            print(f"step {len(losses)} {time.time():.6f}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_AT[1] if len(losses) == PAUSE_AT[0] else STEP_PAUSE)
    return losses


def step_cnn(torch, steps):
    seeded(torch)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = lambda: (torch.randn(32, 3, 32, 32, device="cuda", generator=g),
                     torch.randint(0, 10, (32,), device="cuda", generator=g))
    return curve(train(torch, model, batch, steps))


def curve(losses):
    """A training step's result: ten of its losses, the last, and a digest of them all."""
    every = hashlib.sha256(repr(losses).encode()).hexdigest()[:16]
    return {"losses": losses[:: max(1, len(losses) // 10)], "final": losses[-1], "all": every}


def step_transformer(torch, steps):
    seeded(torch)
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(100, 64), nn.TransformerEncoder(layer, 2), nn.Flatten(), nn.Linear(64 * 16, 100))
    model = model.cuda()
    g = torch.Generator(device="cuda").manual_seed(2)
    batch = lambda: (torch.randint(0, 100, (16, 16), device="cuda", generator=g),
                     torch.randint(0, 100, (16,), device="cuda", generator=g))
    return curve(train(torch, model, batch, steps))


def step_autocast(torch):
    seeded(torch)
    lin = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x).relu()
    return {"dtype": str(y.dtype), "digest": digest(y)}


def step_graph(torch):
    seeded(torch)
    lin = torch.nn.Linear(128, 128).cuda()
    static_in = torch.randn(32, 128, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            lin(static_in)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = lin(static_in).relu()
    outs = []
    for i in range(3):
        static_in.copy_(torch.full((32, 128), float(i), device="cuda"))
        graph.replay()
        outs.append(static_out.clone())
    return {"digest": digest(*outs)}


def step_compile(torch):
    seeded(torch)
    f = torch.compile(lambda x: (x.sin() * x.cos() + x).sum(dim=-1))
    x = torch.randn(256, 256, device="cuda")
    return {"digest": digest(f(x))}


def step_expandable(torch):
    # PYTORCH_CUDA_ALLOC_CONF is read when the allocator starts: run in a child process.
    import subprocess
    code = ("import torch; x = [torch.ones(1 << 20, device='cuda') * i for i in range(8)]; "
            "print(float(sum(t.sum() for t in x)))")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {"sum": out.stdout.strip()}


SAY_STEPS = False     # --say-steps: name each training step on stderr as it ends
STEP_PAUSE = 0.0      # --step-pause-ms: a pause after each training step (the results are the same)
PAUSE_AT = (0, 0.0)   # --pause-at STEP SECONDS: a longer pause after that step (perf/torch_process.py checkpoints there)
STEPS = ["tensors", "matmul", "conv", "autocast", "cnn", "transformer", "graph", "compile", "expandable"]


def run_step(name, train_steps):
    import torch
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    fn = globals()[f"step_{name}"]
    res = fn(torch, train_steps) if name in ("cnn", "transformer") else fn(torch)
    torch.cuda.synchronize()
    return {"ok": True, "result": res, "seconds": round(time.perf_counter() - t0, 3)}


def run(args):
    """Each step in a process of its own: a CUDA error is sticky, and one step's failure must
    not hide what the others do."""
    import subprocess
    results = {}
    for name in args.steps.split(","):
        child = subprocess.run([sys.executable, __file__, "--one", name, "--train-steps", str(args.train_steps)],
                               capture_output=True, text=True, timeout=args.step_timeout)
        sys.stderr.write(child.stderr[-4000:])
        try:
            results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            results[name] = {"ok": False, "error": f"exit {child.returncode}: {child.stderr.strip()[-1500:]}"}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
    return results


def compare(a_path, b_path):
    a, b = json.load(open(a_path)), json.load(open(b_path))
    same = 0
    for name in STEPS:
        ra, rb = a.get(name), b.get(name)
        if ra is None and rb is None:
            continue
        ok = bool(ra and rb and ra.get("ok") and rb.get("ok") and ra["result"] == rb["result"])
        same += ok
        why = "" if ok else f"  native={json.dumps(ra)[:200]}  phos={json.dumps(rb)[:200]}"
        print(f"{name:12s} {'same' if ok else 'DIFFERENT'}{why}")
    print(f"{same} of {len([n for n in STEPS if n in a or n in b])} steps equal")
    return same


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--json")
    p.add_argument("--compare", nargs=2, metavar=("NATIVE", "PHOS"))
    p.add_argument("--one", help=argparse.SUPPRESS)     # run one step here, print its result
    p.add_argument("--say-steps", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-pause-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--pause-at", type=float, nargs=2, default=(0, 0.0), help=argparse.SUPPRESS)
    p.add_argument("--step-timeout", type=float, default=600)
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.one:
        global SAY_STEPS, STEP_PAUSE, PAUSE_AT
        SAY_STEPS, STEP_PAUSE, PAUSE_AT = args.say_steps, args.step_pause_ms / 1e3, (int(args.pause_at[0]), args.pause_at[1])
        try:
            print(json.dumps(run_step(args.one, args.train_steps)))
        except Exception as e:
            traceback.print_exc()
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}))
        return
    results = run(args)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
