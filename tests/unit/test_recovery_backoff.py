"""When a worker takes its recovery images (gpu_server/worker/recovery.py), without a worker."""
import logging

from phos.gpu_server.worker import recovery


def test_failed_images_back_off_and_are_logged_once_in_a_while(tmp_path, monkeypatch, caplog):
    """A full recovery directory made a fresh context try ~60 images a second and log each: the
    next image waits longer after each failure, and the log tells of them once in a while."""
    now = [1000.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    r = recovery.Recovery(str(tmp_path), 7, every_s=1.0)
    tried = 0
    with caplog.at_level(logging.WARNING, logger="phos.recovery"):
        while now[0] < 1000.0 + 120:       # two minutes of a loop asking every 10 ms
            if r.due(ack=5):
                r.begin()
                r.failed("No space left on device")
                tried += 1
            now[0] += 0.01
        failed_lines = [m for m in caplog.messages if "failed" in m]
        assert tried < 20, tried
        assert 1 <= len(failed_lines) <= 3, failed_lines
        assert "No space left on device" in failed_lines[0]
        now[0] += recovery.RETRY_MAX_S
        assert r.due(ack=5)
        r.begin()
        r.committed(cut=5)
    assert "after %d failed in a row" % tried in caplog.messages[-1]
    r.wanted = True                          # the client's log is full: tried at once again
    assert r.due(ack=6)
