"""The sockets between a client and its worker.

A worker keeps the connection of a client it does not read for seconds.

A paced or frozen context, or a long call, leaves the client's messages unread while the
client goes on sending. ZeroMQ's heartbeat answer would then wait behind them, and a heartbeat
timeout drop the connection with the answers on their way to the client (which then finds its
context ran a call whose answer never came). The worker's socket (worker.client_socket) finds
vanished peers by TCP keepalive instead, which a queue that is full does not hold up.

A client told where a handoff will move its context (Reply.movingTo) connects there ahead, once;
a name it cannot connect to is left to the re-attach to report.
"""
import time

import zmq
import zmq.utils.monitor

from phos.client_stub.connection import Connection
from phos.gpu_server.worker.main import client_socket

UNREAD = 7.5     # seconds: the heartbeat it replaces (1 s apart, 5 s to answer) dropped the client after 6
MESSAGE = 8192   # bytes: the queues fill with a few thousand


def test_a_client_whose_messages_wait_unread_for_seconds_stays_connected():
    zctx = zmq.Context()
    worker = client_socket(zctx)
    try:
        port = worker.bind_to_random_port("tcp://127.0.0.1")
        monitor = worker.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        client = zctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"tcp://127.0.0.1:{port}")
        sent, full = 0, False
        deadline = time.monotonic() + UNREAD
        while time.monotonic() < deadline:
            try:
                client.send(sent.to_bytes(8, "little") + bytes(MESSAGE - 8), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:      # every queue between the two is full
                full = True
                time.sleep(0.05)
        assert full, "the client's messages never filled the queues: the test proves nothing"
        events = []
        while monitor.poll(0):
            events.append(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
        assert zmq.EVENT_ACCEPTED in events
        assert zmq.EVENT_DISCONNECTED not in events, "the worker dropped a client it did not read"
        for i in range(sent):      # and every message arrives, in order, once it reads again
            assert worker.poll(2000), f"message {i} of {sent} never came"
            _, body = worker.recv_multipart()
            assert int.from_bytes(body[:8], "little") == i
    finally:
        zctx.destroy(linger=0)


def test_a_client_connects_ahead_once_and_takes_that_connection_when_it_moves():
    conn = Connection("tcp://127.0.0.1:9")
    try:
        conn.connect_ahead("not an endpoint")
        assert conn.ahead is None
        conn.connect_ahead("tcp://127.0.0.1:10")
        first = conn.ahead[1]
        conn.connect_ahead("tcp://127.0.0.1:10")
        assert conn.ahead[1] is first          # named again: the same connection
        conn.connect_ahead("tcp://127.0.0.1:11")
        assert first.closed and conn.ahead[0] == "tcp://127.0.0.1:11"
        ahead = conn.ahead[1]
        conn.close(keep_ahead=True)            # as a re-attach does
        conn.open_socket("tcp://127.0.0.1:11")
        assert conn.sock is ahead and conn.ahead is None and conn.endpoint == "tcp://127.0.0.1:11"
    finally:
        conn.close()
    assert conn.sock.closed
