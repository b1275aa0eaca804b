"""Server start-up, shutdown, security defaults and clean-up of dead clients."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ServerProc, wait_until
from phos.gpu_server.frontend import check_listen

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda


def client_script(address, body, env=""):
    return textwrap.dedent(f"""
        import os
        os.environ["PHOS_SERVER"] = {address!r}
        {env}
        from phos.client_stub import driver as cu
    """) + textwrap.dedent(body)


def test_sigterm_stops_every_worker(backend, tmp_path):
    srv = ServerProc(backend, tmp_path)
    script = client_script(srv.address, """
        assert cu.cuInit(0)[0] == 0
        for _ in range(3):
            assert cu.cuCtxCreate(None, 0, 0)[0] == 0
        print("up", flush=True)
        input()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        workers = srv.workers()
        assert len(workers) == 3
        srv.stop()
        assert srv.proc.returncode == 0
        assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                       for pid in workers), "orphan workers after SIGTERM"
        assert not os.path.exists(srv.address[len("ipc://"):])
    finally:
        child.kill()
        child.wait()


def test_client_that_disconnects_frees_its_context(server):
    before = set(server.workers())
    script = client_script(server.address, """
        assert cu.cuInit(0)[0] == 0
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        err, p = cu.cuMemAlloc(1 << 20)
        assert err == 0
        # exits without cuCtxDestroy
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert wait_until(lambda: set(server.workers()) <= before, timeout=6), "context outlived its client"


def test_no_server_gives_no_device_quickly(tmp_path):
    script = client_script(f"ipc://{tmp_path}/nobody.sock", """
        import time
        t = time.monotonic()
        err, = cu.cuInit(0)
        print(int(err), round(time.monotonic() - t, 1), cu.last_error)
    """, env='os.environ["PHOS_CONNECT_TIMEOUT"] = "1"')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30).stdout.split(" ", 2)
    assert out[0] == "100" and float(out[1]) < 3 and "no phos server" in out[2]


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://myhost:5555"])
def test_non_loopback_listener_needs_auth(address):
    with pytest.raises(ValueError, match="auth-dir"):
        check_listen(address, None)
    check_listen(address, ("pub", "secret", "dir"))


def test_loopback_and_ipc_listeners_are_fine():
    for address in ["tcp://127.0.0.1:5555", "tcp://localhost:1", "ipc:///tmp/x.sock", "tcp://[::1]:5"]:
        check_listen(address, None)
    with pytest.raises(ValueError):
        check_listen("udp://127.0.0.1:5", None)


@pytest.mark.parametrize("address", ["tcp://127.0.0.2:5595@0.0.0.0", "tcp://0.0.0.0:5595@127.0.0.1",
                                     "tcp://127.0.0.1:5595;0.0.0.0:5596", "tcp://127.0.0.1:5595/x"])
def test_a_listener_is_a_plain_host_and_port(address):
    """ZeroMQ would bind another host than the one a URL parser reads from these."""
    with pytest.raises(ValueError, match="plain tcp://HOST:PORT"):
        check_listen(address, None)


def test_keygen_writes_secrets_only_its_user_can_read(tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", str(keys)], check=True, capture_output=True)
    for secret in ("server.key_secret", "client.key_secret"):
        assert (keys / secret).stat().st_mode & 0o777 == 0o600


def test_server_refuses_open_listener_from_cli():
    out = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", "tcp://0.0.0.0:45111"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "auth-dir" in out.stderr


def test_curve_authentication(backend, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", str(keys)], check=True, capture_output=True)
    srv = ServerProc(backend, tmp_path, listen="tcp://127.0.0.1:0".replace(":0", ":45123"), extra=["--auth-dir", str(keys)])
    try:
        body = """
            err, = cu.cuInit(0)
            if err == 0:
                err, ctx = cu.cuCtxCreate(None, 0, 0)
                import numpy as np
                e2, p = cu.cuMemAlloc(64); cu.cuMemsetD8(p, 5, 64); b = np.zeros(64, np.uint8); cu.cuMemcpyDtoH(b, p, 64)
                print(int(err), int(b.sum()))
            else:
                print(int(err))
        """
        env = f'os.environ["PHOS_SERVER_KEY"] = "{keys}/server.key"; os.environ["PHOS_CLIENT_KEY"] = "{keys}/client.key_secret"; os.environ["PHOS_CONNECT_TIMEOUT"] = "2"'
        ok = subprocess.run([sys.executable, "-c", client_script(srv.address, body, env)], capture_output=True, text=True, timeout=60)
        assert ok.stdout.split() == ["0", str(5 * 64)], ok.stderr
        anon = subprocess.run([sys.executable, "-c", client_script(srv.address, body, 'os.environ["PHOS_CONNECT_TIMEOUT"] = "2"')],
                              capture_output=True, text=True, timeout=60)
        assert anon.stdout.split() == ["100"]          # no keys: the server never answers
    finally:
        srv.stop()


def test_a_starting_server_sweeps_what_killed_processes_left_in_shm(servers):
    """A client killed between making its staging file and the worker mapping it, or a server
    killed mid-handoff, leaves a file or a store in /dev/shm: the next server to start removes
    those whose process is gone, and nothing of a live process."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [f"/dev/shm/phos-{dead.pid}-0123456789ab", f"/dev/shm/phos-handoff-{dead.pid}-x_1y2z"]
    kept = [f"/dev/shm/phos-{os.getpid()}-ba9876543210", f"/dev/shm/phos-handoff-{os.getpid()}-keepme", "/dev/shm/phos-notours"]
    for path in left[:1] + kept[:1] + kept[2:]:
        open(path, "wb").close()
    for path in left[1:] + kept[1:2]:
        os.makedirs(path)
        open(os.path.join(path, "chunk"), "wb").close()
    try:
        srv = servers("one")
        assert not any(os.path.exists(p) for p in left)
        assert all(os.path.exists(p) for p in kept)
        assert "removed 2 file(s) that killed processes left in /dev/shm" in srv.output()
    finally:
        for path in left + kept:
            subprocess.run(["rm", "-rf", path])


def test_a_worker_told_to_stop_stops_even_when_the_exit_lands_in_a_callback():
    """A worker stops on SIGTERM (its front end died: PDEATHSIG) by raising SystemExit. Where the
    signal arrives while the garbage collector runs a weakref callback, Python ignores that
    exception; the worker must still end, within seconds, not live on orphaned."""
    import subprocess
    import sys
    import time
    child = """
import time, weakref
from phos.gpu_server.worker import _exit_on_sigterm
class Thing: pass
thing = Thing()
ref = weakref.ref(thing, lambda _: _exit_on_sigterm())
del thing                 # the callback runs now: its SystemExit is ignored
time.sleep(60)
"""
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and time.monotonic() - t < 20, out.stderr
    assert "SystemExit" in out.stderr       # it did land where it was ignored


def test_a_socket_directory_another_user_owns_is_refused(tmp_path):
    """Another user could replace the sockets there: neither the server nor the CLI uses it."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to give the directory to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    server = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{theirs}/phos.sock"],
                            capture_output=True, text=True, timeout=60)
    assert server.returncode != 0 and "belongs to uid 65534" in server.stderr
    cli = subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "list", "--server", f"ipc://{theirs}/phos.sock"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "belongs to uid 65534" in cli.stderr


def test_a_socket_directory_others_may_write_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    server = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{open_dir}/phos.sock"],
                            capture_output=True, text=True, timeout=60)
    assert server.returncode != 0 and "writable by others" in server.stderr
