"""PyTorch's speed natively and through phos's driver, in the same run.

    python3 perf/bench_torch.py [--json OUT] [--only gpt2_train,mlp_train,...]   (perf/device/run.sh bench-torch)

Each workload runs in a process of its own, first natively, then with LD_LIBRARY_PATH=phos/stub
against a `cuda` server started here:

  gpt2_train   a GPT-2-small-sized model (124M parameters, tied embeddings), batch 8 x 1024
               tokens, bf16 autocast, AdamW: the median training step
  gpt2_parts   where gpt2_train's step goes on the device: forward, backward, optimizer; and
               single operations of its shapes (matmuls, attention, layer norm, AdamW)
  gpt2_infer   the same model, batch 1 x 128 tokens, no grad: the median forward pass
  mlp_train    a small MLP (3 x 512, batch 64), launch-bound: a step's mean over 200 steps
  load_4gib    4 GiB of weights host to device: from pageable memory, and from pinned
  checkpoint   (phos alone) gpt2_train while another process checkpoints its context into a
               host store on /dev/shm: the checkpoint's rate, the worker's pause and the
               training steps it overlapped

It needs a GPU and phos's stub (PHOS_STUB_DIR, else phos/stub). Exit status 1 when a run fails.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 1 << 30
TARGETS = {"gpt2_train": 1.10, "mlp_train": 2.0}       # phos / native, at most (issue 22)


# -- the workloads, in the child ---------------------------------------------------------------
def gpt2(torch, layers=12, width=768, heads=12, vocab=50257, context=1024):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(width)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            return self.ln_f(self.blocks(x)) @ self.wte.weight.t()      # tied output head

    return GPT().cuda()


def timed(torch, fn):
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def gpt2_training(torch):
    """GPT-2's training, as gpt2_train and gpt2_parts run it: (model, its fused AdamW, loss()),
    loss() the forward pass of a batch of 8 x 1024 tokens under bf16 autocast."""
    torch.manual_seed(0)
    model = gpt2(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, 50257, (8, 1024), device="cuda")
    y = torch.randint(0, 50257, (8, 1024), device="cuda")

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return model, opt, loss


def gpt2_train(torch, steps, say):
    model, opt, loss = gpt2_training(torch)

    def step():
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(steps):
        times.append(timed(torch, step))
        if say:            # the parent checkpoints at a given step, and lines the steps up with it
            print(f"step {i + 1} {time.time():.6f} {times[-1]:.3f}", file=sys.stderr, flush=True)
    warm = times[3:]
    return {"parameters": sum(p.numel() for p in model.parameters()), "step_ms": statistics.median(warm),
            "step_ms_min": min(warm), "reserved_gib": torch.cuda.memory_reserved() / GiB}


def gpt2_parts(torch, steps, say):
    """Where gpt2_train's step goes, in the device's time (CUDA events): its forward pass,
    backward pass and optimizer step; then single operations of its shapes, each run 50
    times back to back so that the device, not the launches, sets the pace."""
    _, opt, loss = gpt2_training(torch)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    parts = {"forward_ms": [], "backward_ms": [], "optimizer_ms": []}
    for i in range(max(steps, 8)):
        marks[0].record()
        forward = loss()
        marks[1].record()
        forward.backward()
        marks[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks[3].record()
        torch.cuda.synchronize()
        if i >= 3:
            for (key, times), a, b in zip(parts.items(), marks, marks[1:]):
                times.append(a.elapsed_time(b))
    out = {key: statistics.median(times) for key, times in parts.items()}

    def each(fn, n=50):
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    h, w_up, w_down = torch.randn(8192, 768, **bf16), torch.randn(3072, 768, **bf16), torch.randn(768, 3072, **bf16)
    out["matmul_up_ms"] = each(lambda: torch.nn.functional.linear(h, w_up))
    up = torch.nn.functional.linear(h, w_up)
    out["matmul_down_ms"] = each(lambda: torch.nn.functional.linear(up, w_down))
    q, k, v = (torch.randn(8, 12, 1024, 64, requires_grad=True, **bf16) for _ in range(3))
    out["attention_fwd_bwd_ms"] = each(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    out["layernorm_ms"] = each(lambda: torch.nn.functional.layer_norm(up, (3072,)))
    loss().backward()         # gradients for the optimizer's step to apply
    out["adamw_ms"] = each(opt.step, n=10)
    return out


def gpt2_infer(torch, steps, say):
    torch.manual_seed(0)
    model = gpt2(torch).eval()
    x = torch.randint(0, 50257, (1, 128), device="cuda")

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
    times = [timed(torch, forward) for _ in range(max(steps, 8))][5:]
    return {"forward_ms": statistics.median(times), "forward_ms_min": min(times)}


def mlp_train(torch, steps, say):
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512, device="cuda"), torch.randint(0, 10, (64,), device="cuda")

    def steps_of(n):
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    timed(torch, lambda: steps_of(20))
    n = max(steps, 200)
    return {"step_ms": timed(torch, lambda: steps_of(n)) / n}


def load_4gib(torch, steps, say):
    pageable = torch.ones(4 * GiB, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    out = {}
    for name, src in (("pageable", pageable), ("pinned", pinned)):
        best = min(timed(torch, lambda: src.to("cuda", non_blocking=name == "pinned")) for _ in range(3))
        out[f"{name}_GBps"] = 4 * GiB / best / 1e6
    return out


WORKLOADS = {"gpt2_train": gpt2_train, "gpt2_parts": gpt2_parts, "gpt2_infer": gpt2_infer, "mlp_train": mlp_train, "load_4gib": load_4gib}


def one(name, steps, say):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    return WORKLOADS[name](torch, steps, say)


# -- the parent --------------------------------------------------------------------------------
def child(name, steps, env, say=False, on_step=None, timeout=600):
    """Run one workload; on_step(n, wall time, ms) for each step it names. Returns its result
    dict, or {"error": ...}."""
    proc = subprocess.Popen([sys.executable, __file__, "--one", name, "--steps", str(steps)] + (["--say"] if say else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    tail = []
    try:
        for line in proc.stderr:
            parts = line.split()
            if say and len(parts) == 4 and parts[0] == "step":
                if on_step:
                    on_step(int(parts[1]), float(parts[2]), float(parts[3]))
            else:
                tail = (tail + [line])[-40:]
        out = proc.stdout.read()
        proc.wait()
    finally:
        killer.cancel()
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"exit {proc.returncode}: {''.join(tail)[-3000:]}"}


def checkpoint_while_training(server, env, store, steps=40, at=10):
    """gpt2_train through phos; when step `at` ends, another thread checkpoints its context
    (as `phos checkpoint` would) while it trains."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    from phos.schema.control import checkpoint_result
    marks, result = [], {}
    # a worker started for the context pins the host store at the checkpoint (tens of seconds
    # for 32 GiB): the pre-started one, pinned at its start, must hold the training context
    deadline = time.time() + 180
    while admin(server.address).Stats(pb.StatsRequest()).standby_workers < 1:
        if time.time() > deadline:
            return {"error": "the server's pre-started worker was not ready within 180 s"}
        time.sleep(0.5)

    def checkpoint():
        try:
            [ctx] = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
            result["began"] = time.time()
            msgs = list(admin(server.address).Checkpoint(pb.CheckpointRequest(ctx=ctx.id, store=store)))
            result["ended"] = time.time()
            result["result"] = checkpoint_result(msgs[-1].result)
        except Exception as e:        # reported, and the training goes on
            result["error"] = f"{type(e).__name__}: {e}"
    worker = threading.Thread(target=checkpoint)

    def on_step(n, wall, ms):
        marks.append((wall, ms))
        if n == at:
            worker.start()
    trained = child("gpt2_train", steps, env, say=True, on_step=on_step)
    if worker.ident is not None:
        worker.join()
    if "error" in trained or "result" not in result:
        return {"error": trained.get("error") or result.get("error", "no checkpoint was taken")}
    res = result["result"]
    before = statistics.median(ms for _, ms in marks[3:at])
    # a step overlapped the checkpoint when it ended after the checkpoint began and began before it ended
    during = [ms for wall, ms in marks if wall > result["began"] and wall - ms / 1e3 < result["ended"]]
    return {"bytes": res["bytes"], "seconds": res["seconds"], "GBps": res["bytes"] / res["seconds"] / 1e9,
            "pause_ms": res["pause_ms"], "mode": res["mode"], "step_ms_before": before,
            "steps_during": during, "step_ms_during_max": max(during, default=None),
            "phase_ms": res["phase_ms"], "trace_ms": res["trace_ms"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join([*WORKLOADS, "checkpoint"]))
    p.add_argument("--steps", type=int, default=20, help="training steps or forward passes a workload times")
    p.add_argument("--host-memory", default="32G", help="the host store the checkpoint goes to")
    p.add_argument("--json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--say", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.say)))
        return
    sys.path.insert(0, HERE)
    from torch_recovery import Server          # one way to start a server for a perf script
    wanted = args.only.split(",")
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(HERE, "..", "phos", "stub")
    report, failed = {}, False
    with tempfile.TemporaryDirectory(prefix="phos-bench-torch-") as work, \
            tempfile.TemporaryDirectory(prefix="phos-bench-torch-", dir="/dev/shm") as shm:
        store = os.path.join(shm, "store")
        server = Server(work, "server", "cuda", "--host-store", store, "--host-memory", args.host_memory)
        try:
            phos_env = dict(os.environ, LD_LIBRARY_PATH=stub, PHOS_SERVER=server.address)
            for name in [w for w in wanted if w in WORKLOADS]:
                row = report[name] = {"native": child(name, args.steps, dict(os.environ)),
                                      "phos": child(name, args.steps, phos_env)}
                failed |= any("error" in r for r in row.values())
                print(f"{name}: {json.dumps(row)}", flush=True)
            if "checkpoint" in wanted:
                row = report["checkpoint"] = checkpoint_while_training(server, phos_env, store)
                failed |= "error" in row
                print(f"checkpoint: {json.dumps(row)}", flush=True)
        finally:
            server.stop()
            if failed:
                print(f"server log:\n{server.log()[-6000:]}", flush=True)
    print_table(report)
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)
    sys.exit(1 if failed else 0)


def print_table(report):
    def ratio(row, key):
        n, p = row["native"].get(key), row["phos"].get(key)
        return f"{p / n:.2f}x" if n and p else "-"
    print("\n| workload | figure | native | phos | phos / native |\n|---|---|---|---|---|")
    for name, key in (("gpt2_train", "step_ms"), ("gpt2_infer", "forward_ms"), ("mlp_train", "step_ms"),
                      ("load_4gib", "pageable_GBps"), ("load_4gib", "pinned_GBps")):
        row = report.get(name)
        if row:
            fmt = lambda r: f"{r[key]:.3f}" if key in r else r.get("error", "-")[:60]
            target = f" (target <= {TARGETS[name]}x)" if name in TARGETS else ""
            print(f"| {name} | {key} | {fmt(row['native'])} | {fmt(row['phos'])} | {ratio(row, key)}{target} |")
    parts = report.get("gpt2_parts")
    if parts and not any("error" in r for r in parts.values()):
        print("\n| gpt2_parts (device time) | native (ms) | phos (ms) | phos / native |\n|---|---|---|---|")
        for key, n in parts["native"].items():
            print(f"| {key} | {n:.3f} | {parts['phos'][key]:.3f} | {ratio(parts, key)} |")
    c = report.get("checkpoint")
    if c and "error" not in c:
        print(f"\ncheckpoint while training: {c['bytes'] / GiB:.2f} GiB in {c['seconds']:.3f} s ({c['GBps']:.1f} GB/s, "
              f"target >= 45), pause {c['pause_ms']:.1f} ms (target <= 10); training steps {c['step_ms_before']:.1f} ms "
              f"before, {len(c['steps_during'])} overlapped it, the longest {c['step_ms_during_max']} ms")
    elif c:
        print(f"\ncheckpoint while training failed: {c['error'][:2000]}")


if __name__ == "__main__":
    main()
