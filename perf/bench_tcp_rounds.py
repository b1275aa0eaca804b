"""A handoff's rounds over TCP: phos's bulk path against the bare connection they travel on.

    python perf/bench_tcp_rounds.py                          # 512 MiB of 2 MiB chunks, emu
    python perf/bench_tcp_rounds.py --mib 1024 --connections 1,2,4,8    # a sweep (PHOS_HANDOFF_CONNECTIONS)

A target server listens on tcp://127.0.0.1 with CURVE keys (its admin API at the next port,
as for a source on another host). This process plays the source: it fills a store in /dev/shm
with --mib MiB of distinct raw chunks, as a handoff's round leaves them, and sends them all
into a fresh inbox of the target through gpu_server/control/handoff_net.py's RemoteTarget, with the
key pair of a server admitted by the target (the target verifies and stores every chunk).
Beside it, in the same run, bare ZeroMQ DEALER/ROUTER pairs with the same keys move the same
bytes in messages of the same shape (a batch's bytes, a frame a chunk; each answered by a
short reply, two in flight a connection): over one connection, and over as many connections
as phos uses, with as many I/O threads on each side. Each figure is the least, median and
most of --repeat runs.

--connections sets PHOS_HANDOFF_CONNECTIONS for both this process and the target (which
reads it for its admin API's I/O threads); a list sweeps it, a fresh target for each value.
"""
import argparse
import asyncio
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
BARE_WINDOW = 2                  # messages in flight a bare connection, as handoff_net.WINDOW


def keys(directory):
    """A `phos keygen` key directory: (server public, server secret). Its server key is admitted
    by its own admins/, as for servers sharing one --auth-dir: the source uses it."""
    from phos.schema.admin_net import read_key_file
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", directory], check=True, capture_output=True)
    return read_key_file(os.path.join(directory, "server.key_secret"), secret=True)


def fill_store(path, nbytes, chunk):
    """A DirStore at path holding nbytes of distinct raw chunks; their keys."""
    from phos.snapshot import DirStore
    from phos.snapshot.image import encode_chunk
    store, rng, out = DirStore(path, fsync=False), np.random.default_rng(1), []
    for _ in range(max(1, nbytes // chunk)):
        blob, fp = encode_chunk(rng.integers(0, 1 << 63, chunk // 8, dtype=np.uint64).tobytes(), level=None)
        store.put_chunk(fp.hex(), blob)
        out.append(fp.hex())
    return out


def through_phos(server, curve, local, chunk_keys):
    """MiB/s of RemoteTarget sending every chunk of chunk_keys into a fresh inbox of server."""
    from phos.gpu_server.control.handoff_net import RemoteTarget
    from phos.schema import admin_pb2 as pb

    async def send():
        async with RemoteTarget(server.address, 1, curve) as target:
            target.inbox = (await target.ask(target.stub.OpenInbox, pb.OpenInboxRequest(ctx=1), 10)).store
            t = time.perf_counter()
            await target.send_chunks(local, chunk_keys)
            seconds = time.perf_counter() - t
            return target.sent_bytes / MiB / seconds
    return asyncio.run(send())


def bare(nbytes, chunk, connections, curve):
    """MiB/s of nbytes over `connections` CURVE DEALER/ROUTER connections on loopback TCP, in
    messages of a batch's bytes (handoff_net.BATCH_BYTES) in frames of `chunk` bytes, each
    answered by a short reply."""
    from phos.gpu_server.control.handoff_net import BATCH_BYTES
    public, secret = curve
    server_ctx = zmq.Context(io_threads=connections)
    srv = server_ctx.socket(zmq.ROUTER)
    srv.curve_server, srv.curve_secretkey, srv.curve_publickey = True, secret, public
    srv.setsockopt(zmq.LINGER, 0)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    per_message = max(1, BATCH_BYTES // chunk)
    messages = max(1, nbytes // (per_message * chunk))
    body = [np.random.default_rng(i).integers(0, 255, chunk, dtype=np.uint8) for i in range(per_message)]
    clients = []
    for _ in range(connections):
        ctx = zmq.Context()
        cli = ctx.socket(zmq.DEALER)
        cli.curve_serverkey, cli.curve_publickey, cli.curve_secretkey = public, public, secret
        cli.setsockopt(zmq.LINGER, 0)
        cli.connect(f"tcp://127.0.0.1:{port}")
        clients.append((ctx, cli))

    def serve():
        for _ in range(messages):
            peer, *_frames = srv.recv_multipart(copy=False)
            srv.send_multipart([peer, b"ok"])

    def send(cli, count):
        out = 0
        for _ in range(count):
            if out == BARE_WINDOW:
                cli.recv()
                out -= 1
            cli.send_multipart(body, copy=False)
            out += 1
        for _ in range(out):
            cli.recv()
    for _, cli in clients:          # connected and shaken hands before the clock starts
        cli.send(b"hello")
    for _ in clients:
        peer, _msg = srv.recv_multipart()
        srv.send_multipart([peer, b"ok"])
    for _, cli in clients:
        cli.recv()
    server = threading.Thread(target=serve)
    senders = [threading.Thread(target=send, args=(cli, messages // connections + (i < messages % connections)))
               for i, (_, cli) in enumerate(clients)]
    t = time.perf_counter()
    server.start()
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    server.join()
    seconds = time.perf_counter() - t
    for ctx, cli in clients:
        cli.close(0)
        ctx.term()
    srv.close(0)
    server_ctx.term()
    return messages * per_message * chunk / MiB / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="MiB of chunks a run sends")
    ap.add_argument("--chunk-kib", type=int, default=2048, help="chunk size (a handoff's default: 2 MiB)")
    ap.add_argument("--connections", default="", help="PHOS_HANDOFF_CONNECTIONS values, comma-separated "
                    "(default: the setting's own)")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs of each figure (least, median, most)")
    args = ap.parse_args()
    from phos.base import settings
    sweep = [int(c) for c in args.connections.split(",")] if args.connections else [None]
    with tempfile.TemporaryDirectory(prefix="phos-tcp-rounds-") as work, \
            tempfile.TemporaryDirectory(prefix="phos-tcp-rounds-", dir="/dev/shm") as shm:
        public, secret = keys(os.path.join(work, "keys"))
        from phos.snapshot import DirStore
        chunk_keys = fill_store(os.path.join(shm, "round"), args.mib * MiB, args.chunk_kib << 10)
        local = DirStore(os.path.join(shm, "round"), fsync=False, create=False)
        print(f"{args.mib} MiB in {len(chunk_keys)} chunks of {args.chunk_kib} KiB, emu target on tcp://127.0.0.1 "
              f"(CURVE), {os.cpu_count()} cores\n")
        print("| connections | bare, 1 connection (MiB/s) | bare, as many connections (MiB/s) | phos (MiB/s) "
              "| phos / bare as many (median) |\n|---|---|---|---|---|")
        for connections in sweep:
            if connections is not None:
                os.environ["PHOS_HANDOFF_CONNECTIONS"] = str(connections)
            n = settings.handoff_connections()
            server = LocalServer("emu", tempfile.mkdtemp(dir=work), listen=f"tcp://127.0.0.1:{free_port_pair()}",
                                 extra=("--auth-dir", os.path.join(work, "keys")))
            try:
                one, many, phos = [], [], []
                for _ in range(args.repeat):
                    nbytes, chunk = len(chunk_keys) * (args.chunk_kib << 10), args.chunk_kib << 10
                    one.append(bare(nbytes, chunk, 1, (public, secret)))
                    many.append(bare(nbytes, chunk, n, (public, secret)))
                    phos.append(through_phos(server, (public, public, secret), local, chunk_keys))
            finally:
                server.stop()
            print(f"| {n} | {spread_text(one, '.0f')} | {spread_text(many, '.0f')} | {spread_text(phos, '.0f')} | "
                  f"{statistics.median(phos) / statistics.median(many):.2f} |", flush=True)


if __name__ == "__main__":
    main()
