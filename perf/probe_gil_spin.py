"""What a worker thread spinning for its client's next call costs the threads beside it (a
restore's loader, a checkpoint's I/O threads, module images hashed in the background).

    python perf/probe_gil_spin.py [--chunks 40]

A thread fingerprints 2 MiB chunks (pfp1 through NumPy, and through the native library where it
is built) while another spins as the worker's loop does when hot (ZeroMQ's getsockopt in a
loop), with the interpreter's switch interval at 200 µs (PHOS_SWITCH_US) and at 20 µs, and
with the spinner letting go of the lock each turn (time.sleep(0), as gpu_server/worker/loop.py does
while a checkpoint's or restore's threads have work). Prints MiB/s fingerprinted in each case.

On dev (2 vCPUs): NumPy 2,203 MiB/s alone, 144 beside the spinner, 298 at 20 µs, 2,183 when the
spinner lets go; the native pfp1 4,411 alone and 3,063 beside the spinner.
"""
import argparse
import sys
import threading
import time

import numpy as np
import zmq

from phos.snapshot import fingerprint as pfp1


def rate(work, chunks, switch_us, spin, let_go=False):
    sys.setswitchinterval(switch_us / 1e6)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    stop = threading.Event()

    def spinner():
        while not stop.is_set():
            sock.getsockopt(zmq.EVENTS)
            if let_go:
                time.sleep(0)
    spinning = threading.Thread(target=spinner)
    if spin:
        spinning.start()
    start = time.perf_counter()
    worker = threading.Thread(target=lambda: [work() for _ in range(chunks)])
    worker.start()
    worker.join()
    seconds = time.perf_counter() - start
    stop.set()
    if spin:
        spinning.join()
    sock.close()
    return chunks * 2 / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=40)
    args = ap.parse_args()
    raw = np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    view = pfp1._as_bytes_view(raw)
    works = {"NumPy": lambda: pfp1._finish(*pfp1._lane_sums(pfp1._words(view)), len(view))}
    if pfp1._native() is not None:
        works["native"] = lambda: pfp1.fingerprint(raw)
    print("| pfp1 | alone | beside a spinner | the same, 20 µs switch interval | the spinner letting go |")
    print("|---|---|---|---|---|")
    for name, work in works.items():
        figures = [rate(work, args.chunks, 200, False), rate(work, args.chunks, 200, True),
                   rate(work, args.chunks, 20, True), rate(work, args.chunks, 200, True, let_go=True)]
        print(f"| {name} | " + " | ".join(f"{f:,.0f} MiB/s" for f in figures) + " |")


if __name__ == "__main__":
    main()
