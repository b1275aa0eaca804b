"""PyTorch training checkpointed as a whole process, its process and server killed, and
brought back (phos/process.py).

The torch ladder's transformer (perf/torch_ladder.py) trains --steps steps natively, then through
phos's driver, pausing a few seconds after step --at. There `phos checkpoint --pid` images the
process and its context; the process and its server are SIGKILLed; a new server restores the
context and CRIU the process, which trains on to --steps. Its loss curve (every step's loss, by
digest) must equal the native run's. Reports the checkpoint's and the restore's time, with the
CPU and GPU sides apart.

    python3 perf/torch_process.py --steps 200 --at 100 [--backend cuda] [--json OUT]

Needs CRIU 4 (phos.process.find_criu), phos's stub (PHOS_STUB_DIR, else phos/stub), and with
--backend cuda a GPU (perf/device/run.sh process). Exit status 1 when the curve differs or a run fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_recovery import LADDER, Server, wait_for  # noqa: E402  (perf/ is not a package)


def native(steps):
    out = subprocess.run([sys.executable, LADDER, "--one", "transformer", "--train-steps", str(steps)],
                         capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def through_phos(args, work, backend):
    from phos import process
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(os.path.dirname(HERE), "phos", "stub")
    a = Server(work, "a", backend)
    out_path, err_path = os.path.join(work, "train.out"), os.path.join(work, "train.err")
    env = dict(os.environ, PHOS_SERVER=a.address, LD_LIBRARY_PATH=stub)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        app = subprocess.Popen([sys.executable, LADDER, "--one", "transformer", "--train-steps", str(args.steps),
                                "--say-steps", "--pause-at", str(args.at), str(args.pause)],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True)
    report = {}
    try:
        wait_for(lambda: f"step {args.at} " in open(err_path).read(), 1800, f"step {args.at}")
        os.environ["PHOS_SERVER"] = a.address
        report["checkpoint"] = process.checkpoint(app.pid, os.path.join(work, "image"))
        app.wait(60)                           # reaped: the restore takes its PID again
        a.kill()
        b = Server(work, "b", backend)
        try:
            report["restore"] = process.restore(os.path.join(work, "image"), b.address)
            wait_for(lambda: process.pid_state(app.pid) in (None, "Z"), 1800, "the restored training to end")
        finally:
            b.stop()
    finally:
        if app.poll() is None:
            app.kill()
        a.stop()
    lines = open(out_path).read().strip().splitlines()
    report["result"] = json.loads(lines[-1]) if lines else {"ok": False, "error": open(err_path).read()[-2000:]}
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--at", type=int, default=100)
    p.add_argument("--pause", type=float, default=3.0, help="seconds the training waits after --at")
    p.add_argument("--backend", default="emu")
    p.add_argument("--json")
    args = p.parse_args()
    ref = native(args.steps) if args.backend == "cuda" else None
    with tempfile.TemporaryDirectory(prefix="phos-torch-process-", dir="/dev/shm") as work:
        rep = through_phos(args, work, args.backend)
    same = ref is not None and rep["result"].get("ok") and rep["result"]["result"] == ref["result"]
    cp, rs = rep["checkpoint"], rep["restore"]
    print(f"checkpoint at step {args.at}: {cp['ms']['total']:.0f} ms (GPU {cp['ms']['gpu']:.0f} ms for "
          f"{cp['gpu_bytes'] / 2**20:.1f} MiB, CPU {cp['ms']['cpu']:.0f} ms for {cp['process_bytes'] / 2**20:.1f} MiB); "
          f"restore {rs['ms']['total']:.0f} ms (GPU {rs['ms']['gpu']:.0f}, CPU {rs['ms']['cpu']:.0f}, "
          f"re-attach {rs['ms']['attach']:.0f})")
    print(f"loss curve through the checkpoint and restore: {'SAME as native' if same else 'DIFFERENT'}"
          + ("" if same else f"\n  native: {json.dumps(ref)[:400]}\n  phos:   {json.dumps(rep['result'])[:400]}"))
    if args.json:
        json.dump({"native": ref, **rep, "same": bool(same)}, open(args.json, "w"), indent=1)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
