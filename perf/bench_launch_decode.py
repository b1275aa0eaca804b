"""What a launch costs the context worker, before the device: N `launch` calls vs one launchBatch.

    python perf/bench_launch_decode.py [--repeat 5] [--sizes 1,64,256] [--backend null|cuda]

Benchmark only: by default the worker runs on a backend whose `launch` does nothing
(NullBackend), so the figures are the worker's own per-launch cost (decoding the Request,
the checks of calls.run_launch, dispatch) that bounds launch throughput, since the worker
is one Python thread. Real frames go through the real path, Worker.on_frames -> run_calls ->
Session.execute, as they come off the socket. Also times the Python client's encoding of
the same launches. Needs no GPU.

With --backend cuda the launches reach the GPU (an empty kernel, synchronized after each
round), batches through the worker's compiled launch path (gpu_server/backends/native_launch.py) where
it was built, which splits a remote launch's cost into the worker's and the transport's; the
table then also has the backend's launch alone (the driver through ctypes) called from Python in a loop.
A second table times --back-to-back launches (10,000) with one synchronize at the end, as
perf/bench_stub.cu's launch figure does through the stub: the worker's batches of 64, through
the compiled path and through Python, and the backend alone.
"""
import argparse
import struct
import time

import zmq

from phos.gpu_server.address_space import AddressSpace
from phos.gpu_server.backends.backend import Function
from phos.gpu_server.worker.loop import Worker
from phos.gpu_server.worker.session import Session
from phos.schema import wire

PEER = b"bench-client"
PARAMS = [(0, 8), (8, 8), (16, 4)]          # two pointers and an int, like most kernels


class NullBackend:
    """Benchmark only: accepts every launch and does nothing, so only the worker is timed."""
    space = AddressSpace(1 << 30, 1 << 21)      # nothing moved: the launches' words go as they are
    launcher = None                             # the worker's Python path, timed alone

    def launch(self, function, grid, block, shared_bytes, stream, params, options=0):
        pass

    def synchronize(self):
        pass

    def idle(self):
        return True

    def take_output(self):
        return ""


EMPTY_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry empty(.param .u64 a, .param .u64 b, .param .u32 n) { ret; }
"""


def worker_with_kernel(backend_name="null"):
    if backend_name == "cuda":
        from phos.gpu_server.backends.cuda import CudaBackend
        backend = CudaBackend(0)
        fn = backend.get_function(backend.load_module(EMPTY_PTX), "empty")
    else:
        backend, fn = NullBackend(), Function(None, "empty", PARAMS)
    session = Session(backend, 1, b"")
    fn.module_id, fn.size = 0, fn.param_bytes
    worker = Worker(session, sock=None)
    worker.attached.add(PEER)
    return worker, session.add("function", fn)


def driver_alone_us(worker, fid, n, repeat, budget=0.2):
    """The backend's launch (the driver's, through ctypes) from Python in a loop, with nothing
    decoded or checked: the floor under the worker."""
    session = worker.session
    fn = session.lookup("function", fid)
    launch, params = session.backend.launch, bytes(fn.size)

    def run():
        for _ in range(n):
            launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, params)
        session.backend.synchronize()
    return per_launch_us(run, n, repeat, budget)


def mailbox_sync_us(worker, repeat, budget=0.5):
    """A bare cuCtxSynchronize through the staging area's mailbox, as the native stub sends it,
    served by Worker.serve_box (the worker's side of bench_stub's sync round trip, with no
    client and no spinning): the request put, served, its reply read."""
    import numpy as np
    s = worker.session
    s.shm = np.zeros(wire.SLOTS_OFFSET, np.uint8)
    s.box = box = wire.Mailbox(s.shm)
    worker.box_peer = PEER
    bare = wire.BARE_CALLS["ctxSynchronize"]

    def run():
        seq = worker.ack + 1
        box.put(0, seq, bare.fill(seq))
        worker.serve_box()
        assert box.seq(1) == seq and box.take(1) == wire.PLAIN_REPLY.fill(seq, seq), "no success in the mailbox"
    return per_launch_us(run, 1, repeat, budget)


def launches(fid, n):
    config = (1, 1, 1, 32, 1, 1, 0, 0, 0)
    return [(fid, config, struct.pack("<QQi", 0x7F0000000000 + 256 * i, 0x7F0000100000, i)) for i in range(n)]


def encode_single(calls):
    """N `launch` calls in one Request, as clients sent launches before launchBatch."""
    req = wire.Request.new_message(version=wire.PROTOCOL_VERSION)
    for seq, (c, (fid, config, params)) in enumerate(zip(req.init("calls", len(calls)), calls), 1):
        c.seq = seq
        launch = c.init("launch")
        launch.function, launch.config, launch.params = fid, wire.LAUNCH_CONFIG.pack(*config), params
    return req.to_bytes()


def encode_batch(calls):
    """One launchBatch of N records, as the Python client packs it (Connection.post_launch)."""
    blob = bytearray()
    for fid, config, params in calls:
        blob += wire.launch_record(fid, config, params)
    req = wire.Request.new_message(version=wire.PROTOCOL_VERSION)
    c = req.init("calls", 1)[0]
    c.seq, c.launchBatch = len(calls), bytes(blob)
    return req.to_bytes()


def per_launch_us(fn, n, repeat, budget=0.2):
    """Best, over `repeat` rounds, of the mean time of fn() per launch, in microseconds."""
    rounds = max(1, int(budget / max(_once(fn), 1e-6) / repeat))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter() - start) / rounds)
    return best / n * 1e6


def _once(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sizes", default="1,64,256", help="launches per Request")
    ap.add_argument("--backend", choices=["null", "cuda"], default="null")
    ap.add_argument("--back-to-back", type=int, default=10000, help="launches before one synchronize (0: none)")
    opts = ap.parse_args()
    worker, fid = worker_with_kernel(opts.backend)
    cuda = opts.backend == "cuda"
    sync = worker.session.backend.synchronize if cuda else (lambda: None)
    print("| launches per Request | worker: N `launch` (µs/launch) | worker: one launchBatch (µs/launch) | speed-up "
          "| client encode: `launch` (µs/launch) | client encode: launchBatch (µs/launch) |"
          + (" backend launch alone, from Python (µs/launch) |" if cuda else ""))
    print("|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for n in map(int, opts.sizes.split(",")):
        calls = launches(fid, n)
        frames = {name: [zmq.Frame(PEER), zmq.Frame(encode(calls))] for name, encode in
                  (("single", encode_single), ("batch", encode_batch))}
        worker.on_frames(frames["batch"])
        assert worker.session.deferred is None and worker.session.sticky is None, worker.session.deferred
        single = per_launch_us(lambda: (worker.on_frames(frames["single"]), sync()), n, opts.repeat)
        batch = per_launch_us(lambda: (worker.on_frames(frames["batch"]), sync()), n, opts.repeat)
        enc_single = per_launch_us(lambda: encode_single(calls), n, opts.repeat)
        enc_batch = per_launch_us(lambda: encode_batch(calls), n, opts.repeat)
        alone = f" {driver_alone_us(worker, fid, n, opts.repeat):.2f} |" if cuda else ""
        print(f"| {n} | {single:.2f} | {batch:.2f} | {single / batch:.1f}× | {enc_single:.2f} | {enc_batch:.2f} |{alone}")
    if opts.back_to_back:
        n = opts.back_to_back
        batch = [zmq.Frame(PEER), zmq.Frame(encode_batch(launches(fid, 64)))]
        backend = worker.session.backend

        def back_to_back():
            return per_launch_us(lambda: ([worker.on_frames(batch) for _ in range(n // 64)], sync()), n // 64 * 64, opts.repeat, 1.0)
        worker_us = back_to_back()
        python_us = ""
        if backend.launcher is not None:      # the same batches through the worker's Python path
            backend.launcher, native = None, backend.launcher
            python_us = f" {back_to_back():.2f} |"
            backend.launcher = native
        alone = f" {driver_alone_us(worker, fid, n, opts.repeat, 1.0):.2f} |" if cuda else ""
        print(f"\n| {n} launches, then one synchronize | worker: launchBatch of 64 (µs/launch) |"
              + (" the same, Python path (PHOS_NATIVE_LAUNCH=0) |" if python_us else "")
              + (" backend launch alone (µs/launch) |" if cuda else ""))
        print("|---|---|" + ("---|" if python_us else "") + ("---|" if cuda else ""))
        print(f"| back to back | {worker_us:.2f} |{python_us}{alone}")
    print_sync_table(worker, opts.repeat, cuda)


def print_sync_table(worker, repeat, cuda):
    s = worker.session
    served = mailbox_sync_us(worker, repeat)
    alone = per_launch_us(s.backend.synchronize, 1, repeat, 0.5) if cuda else None
    print("\n| a synchronize through the mailbox | worker: served (µs) |" + (" backend synchronize alone, from Python (µs) |" if cuda else ""))
    print("|---|---|" + ("---|" if cuda else ""))
    print(f"| bare cuCtxSynchronize | {served:.2f} |" + (f" {alone:.2f} |" if cuda else ""))


if __name__ == "__main__":
    main()
