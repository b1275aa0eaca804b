"""PyTorch training that goes on through a lost server and through a live handoff.

The torch ladder's CNN (perf/torch_ladder.py) trains natively, then through phos's driver
twice, each time interrupted at step --at while it trains:

  recover   its server is SIGKILLed with its workers. The server took recovery images of
            the context every --every seconds into a directory it shares with a standby;
            the stub re-attaches there, the standby restores the context from the latest
            image and the stub replays the calls after its cut.
  handoff   the context is handed off live to a second server (admin Handoff); each step
            pauses --handoff-pace-ms, so that the training goes on through the handoff.

Each run reports where its time went: to step --at, the gap after it, and the steps after.

Each loss curve (every step's loss, by digest) must equal the native one.

    python3 perf/torch_recovery.py --steps 200 --at 100 [--backend cuda] [--json OUT]

It needs phos's stub (PHOS_STUB_DIR, else phos/stub) and, with --backend cuda, a GPU
(perf/device/run.sh torch). Exit status 1 when a curve differs or a run fails.
"""
import argparse
import json
import os
import shutil
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
            # INFO: its workers' exits and restores, for a report of what went wrong
            self.proc = subprocess.Popen([sys.executable, "-m", "phos.cli", "server", "--backend", backend,
                                          "--listen", self.address, *args], stdout=log, stderr=subprocess.STDOUT,
                                         env={"PHOS_LOG": "INFO", **os.environ})
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


def wait_for(predicate, timeout, what):
    """Until predicate() holds, polling; RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.002)


def server_logs(*servers):
    """The last lines of each server's log, for a report of what went wrong."""
    return "".join(f"\n--- {s.address}:\n" + "".join(s.log().splitlines(True)[-25:]) for s in servers)


def the_context(server):
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    [ctx] = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
    return ctx.id


def handoff(server, to):
    """Hand the server's one context off to `to`; returns what the handoff took."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    r = admin(server.address).Handoff(pb.HandoffRequest(ctx=the_context(server), to=to.address))
    return {"handoff_s": round(r.seconds, 3), "downtime_ms": round(r.downtime_ms, 1), "round_bytes": list(r.round_bytes)}


def train(steps, at=None, act=None, env=None, pace_ms=0.0, stderr_path=None):
    """The ladder's CNN for `steps` steps, pausing pace_ms after each; act() is called when step
    `at` has ended, while the training goes on. Returns (result, seconds, the stderr's tail, when
    each step ended, what act returned); the whole stderr goes to stderr_path."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, LADDER, "--one", "cnn", "--train-steps", str(steps), "--say-steps",
                              "--step-pause-ms", str(pace_ms)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tail, ended, acted = [], [], None      # ended: the child's wall time at the end of each step
    whole = open(stderr_path or os.devnull, "w")
    for line in child.stderr:
        whole.write(line)
        parts = line.split()
        if len(parts) == 3 and parts[0] == "step":
            ended.append(float(parts[2]))
            if int(parts[1]) == at and act:
                try:
                    acted = act()
                except Exception as e:        # the training goes on where it was: say why, and wait for it
                    tail.append(f"at step {at}: {type(e).__name__}: {str(e)[:1500]}\n")
        elif "occupancy of" not in line:      # PHOS_VERBOSE's occupancy queries: thousands of lines
            tail = (tail + [line])[-60:]
    whole.close()
    out = child.stdout.read()
    child.wait()
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {"ok": False, "error": f"exit {child.returncode}"}
    return result, round(time.perf_counter() - t0, 2), "".join(tail), ended, acted


def step_times(ended, at):
    """Where a run's time went: seconds to step `at` from the first step's end, the gap from
    step `at` to the next (the interruption), and the steps after it."""
    if len(ended) <= at:
        return {}
    return {"to_at_s": round(ended[at - 1] - ended[0], 3), "gap_s": round(ended[at] - ended[at - 1], 3),
            "after_s": round(ended[-1] - ended[at], 3)}


def through_phos(server, args, act, pace_ms=0.0):
    stub = os.environ.get("PHOS_STUB_DIR") or os.path.join(HERE, "..", "phos", "stub")
    env = dict(os.environ, LD_LIBRARY_PATH=stub, PHOS_SERVER=server.address, PHOS_VERBOSE="1")
    stderr_path = os.path.join(args.logs, f"torch-{args.mode}-stderr.log") if args.logs else None
    return train(args.steps, args.at, act, env, pace_ms, stderr_path)


def run_recover(directory, args):
    images = os.path.join(directory, "recovery")
    recovering = ("--recovery-dir", images, "--checkpoint-every", str(args.every))
    standby = Server(directory, "standby", args.backend, *recovering)
    first = Server(directory, "first", args.backend, *recovering, "--standby", standby.address)
    return run_through(args, [first, standby], first.kill)


def run_handoff(directory, args):
    # paced: the training goes on through the whole handoff, which takes seconds (the target
    # loads every module the context loaded), while 100 steps of this CNN take 0.2 s
    first, second = Server(directory, "first", args.backend), Server(directory, "second", args.backend)
    return run_through(args, [first, second], lambda: handoff(first, second), args.handoff_pace_ms)


def run_through(args, servers, act, pace_ms=0.0):
    """Train through servers[0], act at step --at; the servers' whole logs are kept in --logs."""
    try:
        result, seconds, err, ended, acted = through_phos(servers[0], args, act, pace_ms)
        return result, seconds, err + server_logs(*servers), "re-attached" in err, ended, acted
    finally:
        for server in servers:
            server.stop()
            if args.logs:
                shutil.copy(server.log_path, os.path.join(args.logs, f"torch-{args.mode}-{os.path.basename(server.log_path)}"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--at", type=int, default=100, help="the step after which the server is lost or the context moves")
    p.add_argument("--every", type=float, default=0.5, help="seconds between recovery images")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--modes", default="recover,handoff")
    p.add_argument("--json")
    p.add_argument("--logs", help="a directory to keep the servers' logs and the runs' stderr in")
    p.add_argument("--handoff-pace-ms", type=float, default=100.0, help="a pause after each step of the handoff run")
    args = p.parse_args()
    native, native_s, err, ended, _ = train(args.steps, args.at)
    if not native.get("ok"):
        raise SystemExit(f"the native run failed: {native}\n{err}")
    times = step_times(ended, args.at)
    print(f"native    {native_s:7.2f} s  final loss {native['result']['final']:.6f}  {times}", flush=True)
    report, failed = {"native": {"seconds": native_s, **times, **native}}, False
    for mode in args.modes.split(","):
        args.mode = mode
        with tempfile.TemporaryDirectory(prefix=f"phos-torch-{mode}-") as directory:
            result, seconds, err, reattached, ended, acted = {"recover": run_recover, "handoff": run_handoff}[mode](directory, args)
        same = bool(result.get("ok")) and result["result"] == native["result"]
        failed |= not (same and reattached)
        times = {**step_times(ended, args.at), **(acted or {})}
        print(f"{mode:9s} {seconds:7.2f} s  loss curve {'equal to native' if same else 'DIFFERENT'}, "
              f"{'re-attached' if reattached else 'never re-attached'}  {times}", flush=True)
        if not same or not reattached:
            print(f"  {json.dumps(result)[:600]}\n  stderr, then the servers' logs:\n{err[-8000:]}", flush=True)
        report[mode] = {"seconds": seconds, "same": same, "reattached": reattached, **times, **result}
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
