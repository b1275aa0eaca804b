"""Copies from a client on another host: phos against the bare connection they travel on.

    python perf/bench_tcp_copies.py                       # emu, 64 MiB copies
    python perf/bench_tcp_copies.py --backend cuda --sizes 1,64,256

A server listens on tcp://127.0.0.1 with CURVE keys, as it would for clients on other hosts,
and the Python client copies to and from a context with no shared staging area
(PHOS_STAGING=0: its bytes travel in frames, as from another host). Beside it, in the same
run, two bare ZeroMQ sockets with the same keys move the same bytes the same way: one
message of the size and a short answer (host to device), a short message and an answer of
the size (device to host). Issue 23's target: phos at >= 80% of the bare connection. Each
figure is the least, median and most of --repeat runs.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

from phos.stub_run import LocalServer, free_port_pair

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import REPEAT, spread_text      # noqa: E402 (beside this script)

MiB = 1 << 20


def keys(directory):
    """A `phos keygen` key directory: (its path, server public, client public, client secret)."""
    from phos.schema.admin_net import read_key_file
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", directory], check=True, capture_output=True)
    server_public = read_key_file(os.path.join(directory, "server.key"))
    server_secret = read_key_file(os.path.join(directory, "server.key_secret"), secret=True)[1]
    client_public, client_secret = read_key_file(os.path.join(directory, "client.key_secret"), secret=True)
    return server_public, server_secret, client_public, client_secret


def bare(nbytes, rounds, k):
    """GB/s of (to the server, from the server) over a CURVE DEALER/ROUTER pair on loopback TCP."""
    server_public, server_secret, client_public, client_secret = k
    ctx = zmq.Context()
    srv, cli = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    srv.curve_server, srv.curve_secretkey, srv.curve_publickey = True, server_secret, server_public
    cli.curve_serverkey, cli.curve_publickey, cli.curve_secretkey = server_public, client_public, client_secret
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    cli.connect(f"tcp://127.0.0.1:{port}")
    body = np.random.randint(0, 255, nbytes, dtype=np.uint8)

    def serve():
        for i in range(2 * rounds):
            peer, msg = srv.recv_multipart(copy=False)
            srv.send_multipart([peer, b"ok" if len(msg) > 64 else body], copy=False)
    th = threading.Thread(target=serve)
    th.start()
    try:
        t = time.perf_counter()
        for _ in range(rounds):
            cli.send(body, copy=False)
            cli.recv(copy=False)
        up = nbytes * rounds / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(rounds):
            cli.send(b"give")
            np.frombuffer(cli.recv(copy=False).buffer, np.uint8).copy()    # into the caller's memory, as a copy lands
        down = nbytes * rounds / (time.perf_counter() - t) / 1e9
    finally:
        th.join()
        srv.close(0)
        cli.close(0)
        ctx.term()
    return up, down


def through_phos(cu, nbytes, rounds):
    """GB/s of cuMemcpyHtoD and cuMemcpyDtoH of nbytes from and into host memory."""
    host = np.random.randint(0, 255, nbytes, dtype=np.uint8)
    back = np.empty_like(host)
    err, ptr = cu.cuMemAlloc(nbytes)
    assert int(err) == 0, cu.last_error
    try:
        assert cu.cuMemcpyHtoD(ptr, host, nbytes) == (0,), cu.last_error     # warm: the worker's first touch
        t = time.perf_counter()
        for _ in range(rounds):
            assert cu.cuMemcpyHtoD(ptr, host, nbytes) == (0,), cu.last_error
        assert cu.cuCtxSynchronize() == (0,)
        up = nbytes * rounds / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(rounds):
            assert cu.cuMemcpyDtoH(back, ptr, nbytes) == (0,), cu.last_error
        down = nbytes * rounds / (time.perf_counter() - t) / 1e9
        assert np.array_equal(back, host), "the bytes came back wrong"
    finally:
        cu.cuMemFree(ptr)
    return up, down


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="emu", choices=["emu", "cuda"])
    ap.add_argument("--sizes", default="64", help="copy sizes in MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=8, help="copies a figure times")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs of each figure (least, median, most)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="phos-tcp-copies-") as work:
        k = keys(os.path.join(work, "keys"))
        server = LocalServer(args.backend, work, listen=f"tcp://127.0.0.1:{free_port_pair()}",
                             extra=("--auth-dir", os.path.join(work, "keys")))
        try:
            os.environ.update(PHOS_SERVER=server.address, PHOS_STAGING="0",
                              PHOS_SERVER_KEY=os.path.join(work, "keys", "server.key"),
                              PHOS_CLIENT_KEY=os.path.join(work, "keys", "client.key_secret"))
            from phos.client_stub import driver as cu
            assert cu.cuInit(0) == (0,), cu.last_error
            err, dev = cu.cuDeviceGet(0)
            err, ctx = cu.cuCtxCreate(None, 0, dev)
            assert int(err) == 0, cu.last_error
            print(f"{args.backend} server at {server.address} (CURVE), the client without a shared staging area\n")
            print("| MiB | direction | bare connection (GB/s) | phos (GB/s) | phos / bare (median) |\n|---|---|---|---|---|")
            for mib in (float(s) for s in args.sizes.split(",")):
                nbytes = int(mib * MiB)
                runs = [(bare(nbytes, args.rounds, k), through_phos(cu, nbytes, args.rounds)) for _ in range(args.repeat)]
                for i, direction in enumerate(("host to device", "device to host")):
                    b, p = [r[0][i] for r in runs], [r[1][i] for r in runs]
                    print(f"| {mib:g} | {direction} | {spread_text(b, '.2f')} | {spread_text(p, '.2f')} | "
                          f"{statistics.median(p) / statistics.median(b):.2f} |", flush=True)
            cu.cuCtxDestroy(ctx)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
