"""The floor under phos's round trip: bare pyzmq DEALER/ROUTER and a shared-memory doorbell.

    python perf/transport_floor.py

Two processes bounce a 64-byte message N times: over ipc:// blocking in poll, over
ipc:// spinning on NOBLOCK receives, and through a spinning shared-memory flag.
"""
import mmap
import multiprocessing as mp
import os
import struct
import tempfile
import time

import zmq

N = 20000


def zmq_server(ep, spin):
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(ep)
    for _ in range(N + 100):
        if spin:
            while True:
                try:
                    f = s.recv_multipart(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    pass
        else:
            f = s.recv_multipart()
        s.send_multipart([f[0], b"x" * 64])


def zmq_client(ep, spin):
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(ep)
    for i in range(N + 100):
        if i == 100:
            t = time.perf_counter()
        s.send(b"y" * 64)
        if spin:
            while True:
                try:
                    s.recv(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    pass
        else:
            s.recv()
    return (time.perf_counter() - t) / N * 1e6


def shm_peer(path, me):
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    view = memoryview(m).cast("Q")
    other = 1 - me
    for i in range(1, N + 101):
        if me == 1:
            while view[0] != i:
                pass
            view[1] = i
        else:
            if i == 101:
                t = time.perf_counter()
            view[0] = i
            while view[1] != i:
                pass
    return (time.perf_counter() - t) / N * 1e6 if me == 0 else 0


def main():
    tmp = tempfile.mkdtemp()
    rows = []
    for name, spin in (("pyzmq ipc, blocking", False), ("pyzmq ipc, spinning", True)):
        ep = f"ipc://{tmp}/floor-{spin}.sock"
        p = mp.Process(target=zmq_server, args=(ep, spin))
        p.start()
        rows.append((name, zmq_client(ep, spin)))
        p.join()
    path = os.path.join(tmp, "shm")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    p = mp.Process(target=shm_peer, args=(path, 1))
    p.start()
    rows.append(("shared-memory flag, spinning", shm_peer(path, 0)))
    p.join()
    print("| transport | round trip (µs) |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
