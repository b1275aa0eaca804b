"""A whole-process checkpoint and restore of an LLM generating tokens through phos (phos/process.py).

A transformers Llama-3.1-8B-shaped model (hidden 4096, 32 layers, random bf16 weights, ~16 GB on
the device) generates tokens greedily, one line per token in a file. At token --at, `phos
checkpoint --pid` images the process (CRIU) and its context (into the server's host store:
pinned memory); the process and the server are killed; a new server on the same host store
restores the context and CRIU the process. Reports the checkpoint's time and the time from the
restore's start to the next token, each with the CPU side and the GPU side apart. CRIUgpu's
published figures for this model on an H100: 77 s to checkpoint, 39 s to restore.

    python3 perf/bench_process.py [--layers 32] [--at 8] [--json OUT]      # on the H200: run.sh process

The model runs in a child: `bench_process.py --generate OUT_FILE`.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_recovery import Server, wait_for  # noqa: E402  (perf/ is not a package)


PROMPT = [[128000, 791, 6864, 315]]


def llama(layers):
    """Llama-3.1-8B's shape with `layers` layers and random bf16 weights, on the device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).eval()


def generate(path, layers, tokens):
    """The application: build the model on the device, then greedy decoding, a line per token."""
    import torch
    model = llama(layers)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.tensor(PROMPT, device="cuda")
    past = None
    with open(path, "a", buffering=1) as out:
        out.write(f"model {params} parameters, {torch.cuda.memory_allocated() / 2**30:.2f} GiB\n")
        with torch.no_grad():
            for i in range(tokens):
                r = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = r.past_key_values
                ids = r.logits[:, -1:].argmax(-1)
                out.write(f"token {i} {int(ids)} {time.time():.6f}\n")


def store_pinned(server):
    """Until the server's pre-started worker has pinned the host store, as a server that runs
    before its applications come has: pinning a store of tens of GiB takes seconds, and a
    context made before it copies through buffers."""
    wait_for(lambda: "pinned host store" in server.log(), 300, "the host store pinned")


def tokens(path):
    with open(path) as f:
        return [line.split() for line in f if line.startswith("token ")]


def bench(args):
    from phos import process
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(os.path.dirname(HERE), "phos", "stub")
    work = tempfile.mkdtemp(prefix="phos-bench-process-", dir="/dev/shm")
    store = os.path.join(work, "host-store")
    a = Server(work, "a", args.backend, "--host-store", store, "--host-memory", args.host_memory)
    store_pinned(a)
    out = os.path.join(work, "tokens.txt")
    env = dict(os.environ, PHOS_SERVER=a.address, LD_LIBRARY_PATH=stub)
    app = subprocess.Popen([sys.executable, __file__, "--generate", out, "--layers", str(args.layers),
                            "--tokens", str(args.tokens)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=open(os.path.join(work, "app.err"), "w"), env=env, start_new_session=True)
    report = {"layers": args.layers}
    b = None
    try:
        wait_for(lambda: os.path.exists(out) and len(tokens(out)) > args.at or app.poll() is not None, 1800,
                 f"token {args.at}")
        if app.poll() is not None:
            raise RuntimeError(f"the model stopped: {open(os.path.join(work, 'app.err')).read()[-3000:]}")
        report["model"] = open(out).readline().strip()
        os.environ["PHOS_SERVER"] = a.address
        cp = process.checkpoint(app.pid, os.path.join(work, "image"), gpu_store=store)
        seen = len(tokens(out))
        app.wait(60)
        a.kill()
        b = Server(work, "b", args.backend, "--host-store", store)
        store_pinned(b)
        t0 = time.time()
        rs = process.restore(os.path.join(work, "image"), b.address)
        wait_for(lambda: len(tokens(out)) > seen, 600, "the next token after the restore")
        next_token = float(tokens(out)[seen][3]) - t0
        report.update(checkpoint=cp, restore=rs, restore_to_next_token_s=next_token)
        app_pid = app.pid
        wait_for(lambda: process.pid_state(app_pid) in (None, "Z") or len(tokens(out)) >= seen + 3, 600, "more tokens")
        # each token's time from the one before, around the cut: is the first one after the restore slow alone?
        times = [float(t[3]) for t in tokens(out)]
        report["token_gaps_s"] = [round(b - a, 4) for a, b in zip(times, times[1:])][max(0, seen - 4):seen + 3]
    finally:
        if args.logs:       # the servers' and the application's logs, for what went slow or wrong
            os.makedirs(args.logs, exist_ok=True)
            for name in ("a.log", "b.log", "app.err"):
                if os.path.exists(os.path.join(work, name)):
                    shutil.copy(os.path.join(work, name), args.logs)
        if app.poll() is None:
            app.kill()
        a.stop()
        if b is not None:
            from phos.process import pid_state
            if pid_state(app.pid) not in (None, "Z"):
                os.kill(app.pid, 9)
            b.stop()
        subprocess.run(["rm", "-rf", work])
    cp, rs = report["checkpoint"], report["restore"]
    print(report["model"])
    print(f"checkpoint: {cp['ms']['total'] / 1e3:.2f} s (GPU {cp['ms']['gpu'] / 1e3:.2f} s for "
          f"{cp['gpu_bytes'] / 2**30:.2f} GiB, CPU {cp['ms']['cpu'] / 1e3:.2f} s for "
          f"{cp['process_bytes'] / 2**30:.2f} GiB, freeze {cp['ms']['freeze']:.0f} ms); target <= 3 s")
    print(f"restore to the next token: {report['restore_to_next_token_s']:.2f} s (GPU {rs['ms']['gpu'] / 1e3:.2f} s, "
          f"CPU {rs['ms']['cpu'] / 1e3:.2f} s, re-attach {rs['ms']['attach']:.0f} ms); target <= 3 s")
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--at", type=int, default=8, help="checkpoint once this many tokens are out")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--host-memory", default="40G", help="the servers' host store (the contexts' images)")
    p.add_argument("--json")
    p.add_argument("--logs", help="copy the servers' and the application's logs into this directory")
    p.add_argument("--generate", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        generate(args.generate, args.layers, args.tokens)
        return
    report = bench(args)
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
