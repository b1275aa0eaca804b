"""Server start-up, shutdown, security defaults and clean-up of dead clients."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ServerProc, wait_until
from test_emu_limits import ENDLESS_PTX
from phos.gpu_server.control.frontend import check_listen
from share_nothing import free_port_pair

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


def test_a_socket_path_needs_no_keys():
    assert check_listen("ipc:///tmp/x.sock", None) is None
    with pytest.raises(ValueError):
        check_listen("udp://127.0.0.1:5", None)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5", "ipc://@phos-test"])
def test_a_keyless_listener_other_local_users_reach_needs_insecure(address):
    """Loopback TCP and abstract sockets have no owner: any user of the host may connect."""
    with pytest.raises(ValueError, match="--insecure"):
        check_listen(address, None)
    assert "without CURVE keys" in check_listen(address, None, insecure=True)
    assert check_listen(address, ("pub", "secret", "dir")) is None


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*", "tcp://127.0.0.1"])
def test_a_tcp_listener_names_its_port(address):
    """The admin socket, caches and ledgers are named after the port: two servers on port 0 shared
    admin-0.sock, the second taking it over."""
    with pytest.raises(ValueError, match="name a port"):
        check_listen(address, None, insecure=True)


def test_an_abstract_listeners_files_are_in_the_users_socket_directory(tmp_path, monkeypatch):
    """An abstract socket has no directory: its admin socket and caches are in the user's socket
    directory, found from any working directory, not in the one the server started in."""
    from phos.base import settings
    from phos.schema.control import admin_socket, module_cache_dir, tenant_ledger_dir
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    home = settings.socket_directory()
    assert admin_socket("ipc://@phos-test") == f"unix:{home}/@phos-test.admin"
    assert module_cache_dir("ipc://@a/b") == f"{home}/@a%2Fb.modules"
    assert os.path.dirname(tenant_ledger_dir("ipc://@phos-test")) == home


def test_server_refuses_a_keyless_loopback_listener_from_cli():
    out = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", "tcp://127.0.0.1:45112"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--insecure" in out.stderr


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
    for directory in (keys, keys / "clients", keys / "admins"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


KEYGEN_WATCHED = """
import os, stat, sys
from phos import cli
root = sys.argv[1]
exposed = []

def reachable_by_others(path):
    # another user opens a file where every directory down to it lets them through and the file lets them read
    d = os.path.dirname(path)
    while d.startswith(root):
        if not os.stat(d).st_mode & (stat.S_IXGRP | stat.S_IXOTH):
            return False
        d = os.path.dirname(d)
    return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))

def watch(event, args):
    # at every file operation keygen makes, as a watcher polling the directory would
    if event in ("open", "os.chmod", "os.rename", "os.replace", "shutil.copyfile") and not exposed:
        for d, _, files in os.walk(root):
            for f in files:
                if f.endswith("key_secret") and reachable_by_others(os.path.join(d, f)):
                    exposed.append(os.path.join(d, f))

sys.addaudithook(watch)
cli.main(["keygen", os.path.join(root, "keys")])
print("EXPOSED", exposed)
"""


def test_keygen_secrets_are_never_readable_by_others_while_written(tmp_path):
    """Not only at the end: from the first byte, no secret is where another user could open it
    (pyzmq creates key files readable by all)."""
    os.chmod(tmp_path, 0o755)
    out = subprocess.run([sys.executable, "-c", KEYGEN_WATCHED, str(tmp_path)], capture_output=True, text=True, check=True)
    assert "EXPOSED []" in out.stdout, out.stdout


def test_server_refuses_open_listener_from_cli():
    out = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", "tcp://0.0.0.0:45111"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "auth-dir" in out.stderr


def test_curve_authentication(backend, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", str(keys)], check=True, capture_output=True)
    srv = ServerProc(backend, tmp_path, listen=f"tcp://127.0.0.1:{free_port_pair()}", extra=["--auth-dir", str(keys)])
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
    """A server killed mid-handoff leaves a store in /dev/shm: the next server to start removes
    those whose process is gone, and nothing of a live process."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [f"/dev/shm/phos-handoff-{dead.pid}-x_1y2z"]
    kept = [f"/dev/shm/phos-handoff-{os.getpid()}-keepme", "/dev/shm/phos-notours", f"/dev/shm/phos-{dead.pid}-0123456789ab"]
    for path in kept[1:]:
        open(path, "wb").close()
    for path in left + kept[:1]:
        os.makedirs(path)
        open(os.path.join(path, "chunk"), "wb").close()
    try:
        srv = servers("one")
        assert not any(os.path.exists(p) for p in left)
        assert all(os.path.exists(p) for p in kept)
        assert "removed 1 file(s) that killed processes left in /dev/shm" in srv.output()
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
from phos.gpu_server.worker.main import _exit_on_sigterm
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


def test_a_socket_directory_below_a_directory_another_user_owns_is_refused(tmp_path):
    """Our own, closed socket directory is no safer than its ancestors: the owner of one could
    swap the tree below it for theirs (and a client sent its hello to their server). Every
    ancestor is checked as OpenSSH checks authorized_keys' path."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to give the directory to another user")
    theirs = tmp_path / "theirs"
    ours = theirs / "ours"
    ours.mkdir(parents=True, mode=0o700)
    os.chown(theirs, 65534, 65534)
    server = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{ours}/phos.sock"],
                            capture_output=True, text=True, timeout=60)
    assert server.returncode != 0 and f"its ancestor {theirs} belongs to uid 65534" in server.stderr, server.stderr
    cli = subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "list", "--server", f"ipc://{ours}/phos.sock"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and f"its ancestor {theirs} belongs to uid 65534" in cli.stderr, cli.stderr


def test_socket_directory_ancestors_writable_by_others_are_refused_unless_sticky(tmp_path):
    from phos.schema.control import private_directory
    shared = tmp_path / "shared"
    ours = shared / "ours"
    ours.mkdir(parents=True, mode=0o700)
    shared.chmod(0o775)                 # a group may write: its members could swap "ours"
    with pytest.raises(ValueError, match=f"its ancestor {shared} is writable by others"):
        private_directory(str(ours))
    shared.chmod(0o1777)                # as /tmp: nobody else may rename or remove our entry
    private_directory(str(ours))
    link = tmp_path / "link"            # a link on the way: where it leads is checked too
    link.symlink_to(shared)
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by others"):
        private_directory(str(link / "ours"))


def test_workers_admit_the_front_ends_clients_alone_and_a_revoked_key_ends_its_context(backend, tmp_path):
    """A client reaches its context's worker directly: the worker checks its key as the front end
    does (a key the server never admitted fails the handshake there too), and removing an admitted
    key's file ends the contexts it opened."""
    import socket
    import zmq
    import zmq.auth
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "phos.cli", "keygen", str(keys)], check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerProc(backend, tmp_path, listen=f"tcp://127.0.0.1:{port}", extra=["--auth-dir", str(keys)])
    env = (f'os.environ["PHOS_SERVER_KEY"] = "{keys}/server.key"; os.environ["PHOS_CLIENT_KEY"] = "{keys}/client.key_secret"; '
           'os.environ["PHOS_REATTACH_TIMEOUT"] = "3"')     # a revoked key's handshakes fail silently
    body = """
        assert cu.cuInit(0)[0] == 0
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        assert err == 0
        print(cu._contexts[int(ctx)].endpoint, flush=True)
        input()
        print(int(cu.cuCtxSynchronize()[0]), flush=True)
    """
    child = subprocess.Popen([sys.executable, "-c", client_script(srv.address, body, env)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    zctx = zmq.Context()
    try:
        endpoint = child.stdout.readline().strip()
        assert endpoint.startswith("tcp://"), child.stderr.read()
        stranger = zctx.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
        stranger.connect(endpoint)
        stranger.send(b"not even a request")
        assert not stranger.poll(2000), "a worker answered a client whose key the server never admitted"
        from phos.admin_cli import stub as admin
        from phos.schema import admin_pb2 as pb
        contexts = lambda: admin(srv.address).ListContexts(pb.ListContextsRequest()).contexts
        assert len(contexts()) == 1
        (keys / "clients" / "client.key").unlink()
        # the worker checks its clients' keys every second
        assert wait_until(lambda: not contexts(), 10), "the revoked key's context lives on"
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        assert out.strip() != "0", err  # its context ended with the key
    finally:
        if child.poll() is None:
            child.kill()
        zctx.destroy(linger=0)
        srv.stop()


def switches(pid):
    """The voluntary context switches of all of a process's threads so far."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def test_an_idle_worker_sleeps(server):
    """A worker whose client maps the mailbox and sends nothing wakes a few times a second, not
    a hundred (200 idle workers filled two cores)."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    body = """
        assert cu.cuInit(0)[0] == 0 and cu.cuCtxCreate(None, 0, 0)[0] == 0
        assert cu.cuCtxSynchronize()[0] == 0
        print("up", flush=True)
        input()
    """
    child = subprocess.Popen([sys.executable, "-c", client_script(server.address, body, 'os.environ["PHOS_STAGING"] = "1"')],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        [ctx] = admin(server.address).ListContexts(pb.ListContextsRequest()).contexts
        time.sleep(1.0)              # past the spin after its last call
        before = switches(ctx.pid)
        time.sleep(2.0)
        woke = switches(ctx.pid) - before
        assert woke < 40, f"an idle worker woke {woke} times in 2 s"
    finally:
        child.kill()
        child.wait()


def test_a_client_that_reads_late_loses_no_reply(server):
    """Up to 10,000 requests sent before reading any reply: every one sent is answered. The
    worker reads no more from a client whose queue of replies is full, so the client's sends
    are held up (here, refused after 2 s) where ZeroMQ dropped half of the replies silently."""
    body = """
        import time, zmq
        from phos.schema import wire
        assert cu.cuInit(0)[0] == 0
        err, ctx = cu.cuCtxCreate(None, 0, 0)
        sock = cu._contexts[int(ctx)].sock
        frame = wire.encode_request([(0, "memGetInfo", None, None)])[0]    # seq 0: outside the call stream
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sent = 0
        try:
            while sent < 10000:
                sock.send(frame)
                sent += 1
        except zmq.Again:
            pass
        time.sleep(1.0)
        answered = 0
        while sock.poll(3000):
            sock.recv_multipart()
            answered += 1
        print(sent, answered)
    """
    out = subprocess.run([sys.executable, "-c", client_script(server.address, body, 'os.environ["PHOS_STAGING"] = "0"')],
                         capture_output=True, text=True, timeout=120)
    sent, answered = out.stdout.split() if out.stdout else (None, None)
    assert sent is not None and int(sent) > 0 and answered == sent, (out.stdout, out.stderr)


# A client whose kernel never ends: it says "spinning", then waits for the kernel and prints
# what its synchronize returned and how long it took.
SPINNING = f"""
import time
assert cu.cuInit(0)[0] == 0 and cu.cuCtxCreate(None, 0, 0)[0] == 0
err, module = cu.cuModuleLoadData({ENDLESS_PTX.encode()!r})
err, f = cu.cuModuleGetFunction(module, b"spin")
assert cu.cuCtxSynchronize()[0] == 0
print("spinning", flush=True)
cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, ((), ()), 0)
t = time.monotonic()
print(int(cu.cuCtxSynchronize()[0]), round(time.monotonic() - t, 1), flush=True)
"""


def test_phos_ctx_kill_ends_a_context_mid_kernel_for_good(servers, tmp_path):
    """`phos ctx kill` ends a context whose kernel never ends: its worker goes at once, its
    client's call fails within seconds, and the server does not restore it from its recovery
    images."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    srv = servers("one", args=["--recovery-dir", str(tmp_path / "rec"), "--checkpoint-every", "600"])
    child = subprocess.Popen([sys.executable, "-c", client_script(srv.address, SPINNING)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning", child.stderr.read()
        [ctx] = admin(srv.address).ListContexts(pb.ListContextsRequest()).contexts
        time.sleep(0.5)                  # inside the kernel
        out = subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "kill", str(ctx.id), "--server", srv.address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and f"context {ctx.id} killed" in out.stdout, out.stderr
        assert wait_until(lambda: not os.path.exists(f"/proc/{ctx.pid}") or open(f"/proc/{ctx.pid}/stat").read().split()[2] == "Z", 5)
        status, seconds = child.communicate(timeout=60)[0].split()
        assert int(status) != 0 and float(seconds) < 10
        assert not admin(srv.address).ListContexts(pb.ListContextsRequest()).contexts   # not restored
        again = subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "kill", str(ctx.id), "--server", srv.address],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "no context" in again.stderr
    finally:
        if child.poll() is None:
            child.kill()


def test_socket_files_go_with_their_worker_and_server(backend, tmp_path):
    """A SIGKILLed worker's socket files are removed by its front end, and a stopped server
    leaves none behind."""
    import glob
    import signal
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    srv = ServerProc(backend, tmp_path)
    sockets = lambda: sorted(glob.glob(str(tmp_path / "*.ctx*")) + glob.glob(str(tmp_path / "*.ctl*")))
    body = """
        assert cu.cuInit(0)[0] == 0
        for _ in range(2):
            assert cu.cuCtxCreate(None, 0, 0)[0] == 0
        print("up", flush=True)
        input()
    """
    child = subprocess.Popen([sys.executable, "-c", client_script(srv.address, body)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        victim = admin(srv.address).ListContexts(pb.ListContextsRequest()).contexts[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert wait_until(lambda: not [p for p in sockets() if f".ctx{victim.id}" in p or f".ctl{victim.id}" in p], 10), sockets()
        assert sockets()              # the other context's, and the pre-started worker's
    finally:
        child.kill()
        child.wait()
        srv.stop()
    assert not sockets()


def test_a_worker_whose_client_dies_mid_kernel_stops(servers, monkeypatch):
    """A kernel that never ends (no launch time limit), and its client killed: the worker ends
    within seconds instead of computing for nobody."""
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    monkeypatch.setenv("PHOS_EMU_LAUNCH_TIMEOUT", "0")
    srv = servers("one")
    child = subprocess.Popen([sys.executable, "-c", client_script(srv.address, SPINNING)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"
        [ctx] = admin(srv.address).ListContexts(pb.ListContextsRequest()).contexts
        time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    assert wait_until(lambda: ctx.pid not in srv.workers(), 10), "the worker computes on for a client that is gone"


def test_a_worker_whose_start_is_cancelled_does_not_outlive_it(tmp_path):
    """A handoff that fails while its warm copy's worker starts cancels that start: the worker
    process goes with it, and the socket files it bound, instead of living on, owned by no one."""
    import asyncio
    import glob

    from phos.gpu_server.control.frontend import FrontEnd
    front = FrontEnd("emu", f"ipc://{tmp_path}/phos.sock")
    started, ready = [], front.worker_ready

    async def slow(proc, token, ctl_token):     # a real worker, whose READY reaches the front end late
        started.append((proc, await ready(proc, token, ctl_token)))
        await asyncio.Event().wait()

    async def scenario():
        front.worker_ready = slow
        start = asyncio.ensure_future(front.start_worker(0, 0, standby=True))
        while not started and not start.done():
            await asyncio.sleep(0.01)
        assert started, start.exception()
        assert started[0][1].startswith("READY "), started
        assert glob.glob(f"{tmp_path}/phos.sock.ct[xl]*"), "the worker bound its sockets"
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        code = await asyncio.wait_for(started[0][0].wait(), 10)
        await asyncio.sleep(0.1)        # the sockets' removal, a task after its exit
        return code

    assert asyncio.run(scenario()) == -9
    assert not glob.glob(f"{tmp_path}/phos.sock.ct[xl]*"), os.listdir(tmp_path)
