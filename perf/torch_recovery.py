"""PyTorch training that goes on through a lost server and through a live handoff.

The torch ladder's CNN (perf/torch_ladder.py) trains natively, then through phos's driver
twice, each time interrupted at step --at while it trains:

  recover   its server is SIGKILLed with its workers. The server took recovery images of
            the context every --every seconds into a directory it shares with a standby;
            the stub re-attaches there, the standby restores the context from the latest
            image and the stub replays the calls after its cut.
  handoff   the context is handed off live to a second server (admin Handoff).

Each loss curve (every step's loss, by digest) must equal the native one.

    python3 perf/torch_recovery.py --steps 200 --at 100 [--backend cuda] [--json OUT]

It needs phos's stub (PHOS_STUB_DIR, else phos/stub) and, with --backend cuda, a GPU
(perf/device/run.sh torch). Exit status 1 when a curve differs or a run fails.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LADDER = os.path.join(HERE, "torch_ladder.py")


class Server:
    def __init__(self, directory, name, backend, *args):
        self.address = f"ipc://{directory}/{name}.sock"
        self.log_path = os.path.join(directory, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "phos.cli", "server", "--backend", backend,
                                          "--listen", self.address, *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "listening on" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {name} did not start:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def kill(self):
        self.proc.kill()            # its workers die with it (PDEATHSIG)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def server_logs(*servers):
    """The last lines of each server's log, for a report of what went wrong."""
    return "".join(f"\n--- {s.address}:\n" + "".join(s.log().splitlines(True)[-25:]) for s in servers)


def the_context(server):
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    [ctx] = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
    return ctx.id


def handoff(server, to):
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    admin(server.address).Handoff(pb.HandoffRequest(ctx=the_context(server), to=to.address))


def train(steps, at=None, act=None, env=None):
    """The ladder's CNN for `steps` steps; act() is called when step `at` has ended, while the
    training goes on. Returns (result, seconds, the stderr's tail)."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, LADDER, "--one", "cnn", "--train-steps", str(steps), "--say-steps"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tail = []
    for line in child.stderr:
        if line.strip() == f"step {at}" and act:
            try:
                act()
            except Exception as e:        # the training goes on where it was: say why, and wait for it
                tail.append(f"at step {at}: {type(e).__name__}: {str(e)[:1500]}\n")
        elif not line.startswith("step "):
            tail = (tail + [line])[-60:]
    out = child.stdout.read()
    child.wait()
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {"ok": False, "error": f"exit {child.returncode}"}
    return result, round(time.perf_counter() - t0, 2), "".join(tail)


def through_phos(server, steps, at, act):
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(HERE, "..", "phos", "stub")
    env = dict(os.environ, LD_LIBRARY_PATH=stub, PHOS_SERVER=server.address, PHOS_VERBOSE="1")
    return train(steps, at, act, env)


def run_recover(directory, args):
    images = os.path.join(directory, "recovery")
    recovering = ("--recovery-dir", images, "--checkpoint-every", str(args.every))
    standby = Server(directory, "standby", args.backend, *recovering)
    first = Server(directory, "first", args.backend, *recovering, "--standby", standby.address)
    try:
        result, seconds, err = through_phos(first, args.steps, args.at, first.kill)
        return result, seconds, err + server_logs(first, standby), "re-attached" in err
    finally:
        first.stop()
        standby.stop()


def run_handoff(directory, args):
    first, second = Server(directory, "first", args.backend), Server(directory, "second", args.backend)
    try:
        result, seconds, err = through_phos(first, args.steps, args.at, lambda: handoff(first, second))
        return result, seconds, err + server_logs(first, second), "re-attached" in err
    finally:
        first.stop()
        second.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--at", type=int, default=100, help="the step after which the server is lost or the context moves")
    p.add_argument("--every", type=float, default=0.5, help="seconds between recovery images")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--modes", default="recover,handoff")
    p.add_argument("--json")
    args = p.parse_args()
    native, native_s, err = train(args.steps)
    if not native.get("ok"):
        raise SystemExit(f"the native run failed: {native}\n{err}")
    print(f"native    {native_s:7.2f} s  final loss {native['result']['final']:.6f}", flush=True)
    report, failed = {"native": {"seconds": native_s, **native}}, False
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"phos-torch-{mode}-") as directory:
            result, seconds, err, reattached = {"recover": run_recover, "handoff": run_handoff}[mode](directory, args)
        same = bool(result.get("ok")) and result["result"] == native["result"]
        failed |= not (same and reattached)
        print(f"{mode:9s} {seconds:7.2f} s  loss curve {'equal to native' if same else 'DIFFERENT'}, "
              f"{'re-attached' if reattached else 'never re-attached'}", flush=True)
        if not same or not reattached:
            print(f"  {json.dumps(result)[:600]}\n  stderr, then the servers' logs:\n{err[-8000:]}", flush=True)
        report[mode] = {"seconds": seconds, "same": same, "reattached": reattached, **result}
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
