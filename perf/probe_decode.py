"""Where a token's time goes when an LLM decodes through phos: natively against through the stub.

perf/bench_process.py's model (Llama-3.1-8B-shaped, fewer layers here) decodes greedily, one
token at a time with its KV cache, natively and then on phos's libcuda.so.1 against a cuda server;
then once more through phos with PHOS_VERBOSE=2, which names every driver call: the calls made
between two tokens, counted by name, say what a token asks of the driver (and of the server).
Each of the model's matrix-vector products is also timed alone, on the GPU, both ways, and the
decode again with cuDNN's attention put last; the stub's verbose line names the synchronous calls
the program waited for longest.

    python3 perf/probe_decode.py [--layers 4] [--tokens 30] [--json OUT]      # on a GPU: run.sh probe-decode
"""
import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_process import PROMPT, llama  # noqa: E402  (perf/ is not a package)
from torch_recovery import Server  # noqa: E402

WARMUP = 5


def decode(layers, tokens):
    """The application: the model on the device, then `tokens` greedy steps; each step's end is
    marked on stderr, where the stub names its calls, and the step times are printed as JSON."""
    import torch
    model = llama(layers)
    ids = torch.tensor(PROMPT, device="cuda")
    past, times, out = None, [], []
    profile = cProfile.Profile() if os.environ.get("PHOS_PROBE_PROFILE") else None
    with torch.no_grad():
        for i in range(WARMUP + tokens):
            if profile and i == WARMUP:
                profile.enable()
            t0 = time.perf_counter()
            r = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = r.past_key_values
            ids = r.logits[:, -1:].argmax(-1)
            out.append(int(ids))
            times.append(time.perf_counter() - t0)
            print(f"probe-decode: token {i}", file=sys.stderr, flush=True)
    if profile:     # where the Python of a token waits: the functions that hold it longest, by their own time
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
        print("probe-decode: profile\n" + text.getvalue(), file=sys.stderr, flush=True)
    print(json.dumps({"ms": [round(t * 1e3, 3) for t in times[WARMUP:]], "tokens": out}), flush=True)


# The model's matrix-vector products at batch 1 (out, in): attention, its KV heads, the MLP, the LM head
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]


def pieces():
    """Each of the model's bf16 products alone, timed on the GPU with CUDA events: is a kernel
    slower through phos (another kernel chosen), or only the way to it?"""
    import torch
    torch.manual_seed(0)
    result = {}
    for out_features, in_features in SHAPES:
        w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(50):
            torch.nn.functional.linear(x, w)
        end.record()
        end.synchronize()
        result[f"{out_features}x{in_features}"] = {"gpu_ms": round(start.elapsed_time(end) / 50, 4),
                                                  "wall_ms": round((time.perf_counter() - t0) * 1e3 / 50, 4)}
    print(json.dumps(result), flush=True)


def run(layers, tokens, env, mode="--decode"):
    r = subprocess.run([sys.executable, __file__, mode, "--layers", str(layers), "--tokens", str(tokens)],
                       capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"the model failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def calls_per_token(stderr, first, last):
    """The driver calls named between the end of token `first` and that of token `last`, by name, per token."""
    counts, inside = collections.Counter(), False
    for line in stderr.splitlines():
        if line.startswith("probe-decode: token "):
            n = int(line.split()[-1])
            inside = first <= n < last
        elif inside and (m := re.match(r"phos: call (\S+) -> (-?\d+)", line)):
            counts[m.group(1) if m.group(2) == "0" else f"{m.group(1)} -> {m.group(2)}"] += 1
    return {name: round(c / (last - first), 1) for name, c in counts.most_common()}


def median(values):
    s = sorted(values)
    return s[len(s) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--json")
    p.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pieces", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.decode:
        decode(args.layers, args.tokens)
        return
    if args.pieces:
        pieces()
        return
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(os.path.dirname(HERE), "phos", "stub")
    report = {"layers": args.layers}
    native, _ = run(args.layers, args.tokens, dict(os.environ))
    report["native_ms"] = native["ms"]
    report["pieces_native"], _ = run(args.layers, 0, dict(os.environ), "--pieces")
    work = tempfile.mkdtemp(prefix="phos-probe-decode-", dir="/tmp")
    server = Server(work, "server", args.backend)
    try:
        env = dict(os.environ, PHOS_SERVER=server.address, LD_LIBRARY_PATH=stub, PHOS_VERBOSE="1")
        phos, err = run(args.layers, args.tokens, env)
        report["phos_ms"] = phos["ms"]
        report["same_tokens"] = phos["tokens"] == native["tokens"]
        report["pieces_phos"], _ = run(args.layers, 0, env, "--pieces")
        # PyTorch puts cuDNN's attention first on sm90 (a graph built for each new key length, so
        # for every decoded token); these variables put it last (the names of 2.11 and of later releases)
        no_cudnn = {"TORCH_CUDNN_SDPA_PREFERRED": "0", "TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
        report["native_ms_without_cudnn_attention"] = run(args.layers, args.tokens, dict(os.environ, **no_cudnn))[0]["ms"]
        report["phos_ms_without_cudnn_attention"] = run(args.layers, args.tokens, dict(env, **no_cudnn))[0]["ms"]
        report["stub_counters"] = [line for line in err.splitlines() if "requests through the mailbox" in line]
        _, err = run(args.layers, 4, dict(env, PHOS_VERBOSE="2"))
        report["calls_per_token"] = calls_per_token(err, WARMUP, WARMUP + 3)
        _, err = run(args.layers, 5, dict(env, PHOS_PROBE_PROFILE="1"))
        report["profile"] = err.split("probe-decode: profile", 1)[-1][:6000]
        report["server_slow_messages"] = [line for line in server.log().splitlines() if "took" in line][-20:]
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", work])
    n, f = median(report["native_ms"]), median(report["phos_ms"])
    print(f"{args.layers} layers: a token takes {n:.2f} ms natively, {f:.2f} ms through phos ({f / n:.1f}x); "
          f"tokens {'equal' if report['same_tokens'] else 'DIFFER'}")
    n2, f2 = median(report["native_ms_without_cudnn_attention"]), median(report["phos_ms_without_cudnn_attention"])
    print(f"without cuDNN's attention first: {n2:.2f} ms natively, {f2:.2f} ms through phos ({f2 / n2:.1f}x)")
    print("driver calls per token through phos:", json.dumps(report["calls_per_token"]))
    for shape, n in report["pieces_native"].items():
        f = report["pieces_phos"][shape]
        print(f"linear {shape}, bf16, batch 1: GPU {n['gpu_ms']:.4f} ms natively, {f['gpu_ms']:.4f} ms through phos; "
              f"wall {n['wall_ms']:.4f} / {f['wall_ms']:.4f} ms")
    print("through phos, 5 tokens, by own time:", report["profile"])
    for line in report["stub_counters"] + report["server_slow_messages"]:
        print(line)
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
