"""The `phos` command line."""
import argparse
import logging
import os
import sys

from phos.base import settings
from phos.base.keys import load_curve


def default_server():
    return settings.server()


def cmd_server(opts):
    from phos.gpu_server.control import frontend
    logging.basicConfig(level=opts.log_level, format="%(asctime)s %(name)s[%(process)d] %(message)s")
    curve = load_curve(opts.auth_dir) if opts.auth_dir else None
    recovery = None
    if opts.recovery_dir:
        os.makedirs(opts.recovery_dir, exist_ok=True)
        recovery = frontend.RecoveryOptions(os.path.abspath(opts.recovery_dir), opts.checkpoint_every,
                                            opts.checkpoint_calls, opts.standby or "")
    elif opts.checkpoint_every or opts.checkpoint_calls or opts.standby:
        raise SystemExit("phos server: --checkpoint-every, --checkpoint-calls and --standby need --recovery-dir")
    if opts.checkpoint_every < 0 or opts.checkpoint_calls < 0:
        raise SystemExit("phos server: --checkpoint-every and --checkpoint-calls must not be negative")
    host_store = host_store_option(opts)
    image_key_option(opts)
    try:
        frontend.run(opts.backend, opts.listen, curve, pool=opts.pool, recovery=recovery, host_store=host_store,
                     insecure=opts.insecure, devices=opts.devices)
    except ValueError as e:
        raise SystemExit(f"phos server: {e}")
    return 0


def image_key_option(opts):
    """--image-key FILE: the key this server signs and checks images with, read (or, the user's
    default one, made) now, so that a bad one stops the server before it serves. Its workers
    find it where the front end does: PHOS_IMAGE_KEY, which they inherit."""
    from phos.snapshot import ImageError
    from phos.snapshot.image_key import image_key
    if opts.image_key:
        os.environ[settings.image_key.name] = os.path.abspath(opts.image_key)
    try:
        image_key()
    except ImageError as e:
        raise SystemExit(f"phos server: {e}")


def host_store_option(opts):
    """--host-store DIR [--host-memory SIZE]: the host store's path, made first if SIZE is given
    and DIR holds none yet."""
    from phos.snapshot.host_store import HostStore, ImageError, is_host_store, parse_size
    if opts.host_store is None:
        if opts.host_memory:
            raise SystemExit("phos server: --host-memory needs --host-store DIR (a directory on /dev/shm, for memory)")
        return None
    path = os.path.abspath(opts.host_store)
    try:
        if not is_host_store(path):
            if not opts.host_memory:
                raise SystemExit(f"phos server: {path} holds no host store; give --host-memory SIZE to make one")
            HostStore.create(path, parse_size(opts.host_memory))
        return path
    except (ImageError, ValueError, OSError) as e:
        raise SystemExit(f"phos server: host store {path}: {e}")


def cmd_keygen(opts):
    """Server keys and one client key pair. The client's public key goes into clients/ (it may
    make contexts) and admins/ (it may call the admin API over TCP: the operator's key); the
    server's own public key into admins/ too, so that servers sharing this directory hand
    contexts off to each other (a server calls another's admin API with its own key pair).
    Tenants' keys are added to clients/ alone.

    pyzmq writes key files readable by all: they are written into a directory of mode 0700
    made for them, where no other user can open them, and moved into place once 0600."""
    import shutil
    import tempfile
    import zmq.auth
    for sub in ("", "clients", "admins"):
        os.makedirs(os.path.join(opts.dir, sub), mode=0o700, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".keygen-", dir=opts.dir)       # mode 0700
    try:
        zmq.auth.create_certificates(staging, "server")
        zmq.auth.create_certificates(staging, "client")
        for secret in ("server.key_secret", "client.key_secret"):
            os.chmod(os.path.join(staging, secret), 0o600)
        for name in ("client.key", "server.key"):
            shutil.copy(os.path.join(staging, name), os.path.join(opts.dir, "admins", name))
        os.replace(os.path.join(staging, "client.key"), os.path.join(opts.dir, "clients", "client.key"))
        for name in ("server.key", "server.key_secret", "client.key_secret"):
            os.replace(os.path.join(staging, name), os.path.join(opts.dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"server keys and one client key pair written to {opts.dir}; "
          f"clients use PHOS_SERVER_KEY={opts.dir}/server.key PHOS_CLIENT_KEY={opts.dir}/client.key_secret "
          f"(the same keys reach the admin API of a tcp:// server, at its port + 1)")
    return 0


def cmd_run(opts):
    from phos import stub_run
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    if not argv:
        raise SystemExit("phos run: give the program to run after --")
    return stub_run.run(argv, opts.server)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="phos", description="GPU API remoting with snapshottable contexts")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("server", help="run a GPU server")
    p.add_argument("--backend", choices=["cuda", "emu"], default="emu")
    p.add_argument("--devices", default="all", metavar="all|LIST",
                   help="the devices to serve: all (the default), or their numbers, e.g. 0,1; applications number "
                   "them from 0 in that order, as with CUDA_VISIBLE_DEVICES (emu: PHOS_EMU_DEVICES says how many it has)")
    p.add_argument("--listen", default=default_server(), help="ipc://PATH or tcp://127.0.0.1:PORT")
    p.add_argument("--auth-dir", help="CURVE keys made by `phos keygen`; required for tcp and abstract ipc://@NAME")
    p.add_argument("--insecure", action="store_true", help="allow a keyless listener other local users can reach "
                   "(tcp://127.0.0.1:PORT, ipc://@NAME); logged as a warning")
    p.add_argument("--pool", type=int, default=settings.pool(),
                   help="workers kept started with an initialized device, ready for a new context or a restore")
    p.add_argument("--recovery-dir", help="take recovery images of every context here, so that a context whose "
                   "worker or server dies is restored (transparent recovery); share it with the --standby")
    p.add_argument("--checkpoint-every", type=float, default=0.0, metavar="SECONDS",
                   help="seconds between a context's recovery images (besides when its client's log is full)")
    p.add_argument("--checkpoint-calls", type=int, default=0, metavar="N", help="calls between recovery images")
    p.add_argument("--standby", metavar="ADDR", help="the server (with the same --recovery-dir) that clients turn "
                   "to if this one dies")
    p.add_argument("--host-store", metavar="DIR", help="an image store in shared host memory that pre-started workers "
                   "pin, so checkpoints and restores into it run at the host link's speed")
    p.add_argument("--host-memory", metavar="SIZE", help="make the --host-store this big (e.g. 40G) if it does not exist")
    p.add_argument("--image-key", metavar="FILE", default=settings.image_key.raw(),
                   help="the key this server signs its images with and checks them by (HMAC-SHA256): servers "
                   "given the same file restore each other's images; default: PHOS_IMAGE_KEY, else the user's own "
                   "key, made on first use (~/.config/phos/image.key)")
    p.add_argument("--log-level", default=settings.log_level())
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("keygen", help="make CURVE keys for a server reachable from other hosts")
    p.add_argument("dir")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("run", help="run an unmodified CUDA program against a phos server")
    p.add_argument("--server", default=settings.server.raw(), help="server address; default: start a local emu server")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    from phos import admin_cli
    admin_cli.add_commands(sub, default_server)
    from phos import pool_cli
    pool_cli.add_commands(sub)

    opts = ap.parse_args(argv)
    return opts.func(opts)


if __name__ == "__main__":
    sys.exit(main())
