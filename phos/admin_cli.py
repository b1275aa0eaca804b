"""`phos ctx list`, `phos ctx kill`, `phos checkpoint`, `phos restore`, `phos image inspect`: clients of the admin API.

Loads no server code (phos.gpu_server, phos.snapshot) at import: only the admin API's schema."""
import argparse
import json
import os
import sys
import time

from phos.schema import admin_pb2 as pb
from phos.schema.control import checkpoint_result

GiB = 1 << 30


def stub(server):
    """The admin API of the server at `server` (open_admin: its Unix socket, or over TCP with
    PHOS_SERVER_KEY and PHOS_CLIENT_KEY for tcp://HOST:PORT)."""
    from phos.schema.admin_net import open_admin
    try:
        return open_admin(server)
    except ValueError as e:
        raise SystemExit(f"phos: {e}")


def call(fn, *args):
    """Run an RPC; a gRPC failure becomes a one-line error and exit status 1."""
    import grpc
    try:
        return fn(*args)
    except grpc.RpcError as e:
        code = e.code()
        detail = e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in detail.lower():
            detail = f"no phos server admin socket answers ({detail})"
        raise SystemExit(f"phos: {detail} [{code.name}]")


def human(nbytes):
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def bar(done, total, start, out=sys.stderr):
    """A one-line progress bar, redrawn in place."""
    frac = done / total if total else 1.0
    width = 30
    rate = done / max(time.perf_counter() - start, 1e-9)
    out.write(f"\r[{'#' * int(frac * width):<{width}}] {frac * 100:5.1f}%  {human(done)} / {human(total)}  {rate / 1e9:.2f} GB/s ")
    out.flush()


def ctx_list(opts):
    reply = call(stub(opts.server).ListContexts, pb.ListContextsRequest())
    rows = [{"id": c.id, "device": c.device, "bytes": c.bytes, "allocations": c.allocations, "last_seq": c.last_seq,
             "pid": c.pid, "state": c.state} for c in reply.contexts]
    if opts.json:
        print(json.dumps(rows))
        return 0
    print(f"{'CONTEXT':>16}  {'DEVICE':>6}  {'MEMORY':>12}  {'ALLOCS':>6}  {'LAST CALL':>9}  {'PID':>7}  STATE")
    for r in rows:
        print(f"{r['id']:>16}  {r['device']:>6}  {human(r['bytes']):>12}  {r['allocations']:>6}  {r['last_seq']:>9}  "
              f"{r['pid']:>7}  {r['state']}")
    return 0


def byte_size(text):
    """An argument such as 8G or 512M, in bytes (argparse's type)."""
    from phos.snapshot.host_store import parse_size        # here: an admin command loads no server code otherwise
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def process_call(fn, *args):
    """Run a whole-process operation (phos/process.py); its failure becomes a one-line error."""
    from phos.process import ProcessError
    try:
        return fn(*args)
    except ProcessError as e:
        raise SystemExit(f"phos: {e}")


def checkpoint(opts):
    if opts.pid is not None:
        return checkpoint_process(opts)
    if len(opts.args) != 2 or not opts.args[0].isdigit():
        raise SystemExit("phos checkpoint: give CTX DIR (a context), or --pid PID DIR (a whole process)")
    opts.ctx, opts.dir = int(opts.args[0]), os.path.abspath(opts.args[1])
    req = pb.CheckpointRequest(ctx=opts.ctx, store=opts.dir, name=opts.name or "", paused=opts.pause,
                               incremental=opts.incremental, compress=opts.compress, chunk_size=opts.chunk_size,
                               bytes_per_second=opts.rate)
    start, result = time.perf_counter(), None
    show = not opts.json and sys.stderr.isatty() or opts.progress
    for msg in call(lambda: list(_stream(stub(opts.server).Checkpoint(req), start, show))):
        result = checkpoint_result(msg.result)
    if opts.json:
        print(json.dumps(result))
        return 0
    secs = result["seconds"]
    print(f"checkpoint {result['name']} of context {opts.ctx} in {opts.dir}: {human(result['bytes'])} in {secs * 1e3:.1f} ms "
          f"({result['bytes'] / max(secs, 1e-9) / 1e9:.2f} GB/s), copied {human(result['copied_bytes'])}, "
          f"stored {human(result['stored_bytes'])}; the application paused {result['pause_ms']:.2f} ms"
          + (" (validation found a change: paused to recopy)" if result["paused"] and result["mode"] == "concurrent" else ""))
    return 0


def checkpoint_process(opts):
    from phos import process
    if len(opts.args) != 1:
        raise SystemExit("phos checkpoint --pid PID DIR: give one directory")
    r = process_call(process.checkpoint, opts.pid, os.path.abspath(opts.args[0]), opts.leave_running, opts.shell_job,
                     None, opts.gpu_store)
    if opts.json:
        print(json.dumps(r))
        return 0
    ms = r["ms"]
    print(f"process {r['pid']} ({r['stub']} stub) checkpointed into {r['directory']} in {ms['total']:.1f} ms: "
          f"{len(r['contexts'])} context(s), {human(r['gpu_bytes'])} of device memory in {ms['gpu']:.1f} ms; "
          f"the process, {human(r['process_bytes'])}, in {ms['cpu']:.1f} ms; "
          + ("it goes on" if r["leave_running"] else "it has stopped"))
    return 0


def restore_process(opts):
    from phos import process
    r = process_call(process.restore, opts.dir, opts.server)
    if opts.json:
        print(json.dumps(r))
        return 0
    ms = r["ms"]
    print(f"process {r['pid']} restored with {len(r['contexts'])} context(s) on {r['server']} in {ms['total']:.1f} ms "
          f"(contexts {ms['gpu']:.1f} ms, the process {ms['cpu']:.1f} ms, re-attached {ms['attach']:.1f} ms)")
    return 0


def migrate(opts):
    from phos import process
    r = process_call(process.migrate, opts.pid, opts.to, opts.via and os.path.abspath(opts.via), opts.shell_job,
                     opts.remote)
    if opts.json:
        print(json.dumps(r))
        return 0
    ms, down = r["ms"], r["downtime_ms"]
    print(f"process {r['pid']} moved to {r['to']}{' through ' + r['remote'] if r['remote'] else ''} in "
          f"{ms['total']:.1f} ms: its contexts by handoff (their calls held "
          f"{down['contexts']:.1f} ms at most), then the process ({human(r['process_bytes'])}), stopped "
          f"{down['process']:.1f} ms: dump {ms['dump']:.1f}, restore {ms['restore']:.1f}, re-attach {ms['attach']:.1f}")
    return 0


def _stream(responses, start, show):
    for msg in responses:
        if show:
            bar(msg.done_bytes, msg.total_bytes, start)
        if msg.finished:
            if show:
                sys.stderr.write("\n")
            yield msg


def restore(opts):
    if opts.process:
        return restore_process(opts)
    reply = call(stub(opts.server).Restore, pb.RestoreRequest(store=opts.dir, name=opts.name or "", full=opts.full))
    out = {"ctx": reply.ctx, "name": reply.name, "cut_seq": reply.cut_seq, "bytes": reply.bytes, "seconds": reply.seconds}
    if opts.json:
        print(json.dumps(out))
    else:
        how = "loaded" if opts.full else "usable (contents load on demand)"
        print(f"context {reply.ctx} restored from {reply.name} ({human(reply.bytes)}), {how} after {reply.seconds * 1e3:.1f} ms")
    return 0


def handoff(opts):
    if opts.chunk_mb < 0:
        raise SystemExit("phos: --chunk-mb must be 0 (the default, 2) or more")
    if opts.to_device is not None and opts.to_device < 0:
        raise SystemExit("phos: --to-device: give a device number, 0 or more")
    to_key = ""
    if opts.to_key:
        from phos.schema.admin_net import read_key_file
        try:
            to_key = read_key_file(opts.to_key).decode()
        except ValueError as e:
            raise SystemExit(f"phos: --to-key: {e}")
    reply = call(stub(opts.server).Handoff, pb.HandoffRequest(ctx=opts.ctx, to=opts.to or "", to_device=opts.to_device,
                                                              max_rounds=opts.rounds, chunk_size=opts.chunk_mb << 20,
                                                              to_server_key=to_key))
    out = {"ctx": reply.ctx, "to": reply.to, "chunk_size": reply.chunk_size, "round_bytes": list(reply.round_bytes),
           "downtime_ms": reply.downtime_ms,
           "seconds": reply.seconds, "round_ms": list(reply.round_ms), "phase_ms": {k: round(v, 3) for k, v in sorted(reply.phase_ms.items())},
           "recovery_store": reply.recovery_store, "recovery_image": reply.recovery_image}
    if opts.json:
        print(json.dumps(out))
    else:
        rounds = ", ".join(human(b) for b in reply.round_bytes)
        print(f"context {reply.ctx} moved to {reply.to} in {reply.seconds * 1e3:.1f} ms; rounds copied {rounds}; "
              f"its calls were held {reply.downtime_ms:.1f} ms")
        if reply.recovery_image:
            print(f"its recovery image there: {reply.recovery_image} in {reply.recovery_store}")
    return 0


def image_inspect(opts):
    from phos.snapshot import latest_image
    from phos.snapshot import ImageError, open_store, read_image
    try:
        store = open_store(opts.dir)
        name = opts.name or latest_image(store)
        if not name:
            raise SystemExit(f"phos: no readable image in {opts.dir}")
        m = read_image(store, name)
    except ImageError as e:
        raise SystemExit(f"phos: {e}")
    if opts.json:
        print(m.to_json())
        return 0
    d = m.to_dict()
    print(f"image {name} (format {d['format']} v{d['version']}), parent {d['parent']}, backend {d['backend']}, "
          f"device {d['device']['name']}, cut at call {d['cut_seq']}")
    print(f"  {len(d['modules'])} modules, {len(d['functions'])} functions, {len(d['streams'])} streams, "
          f"{len(d['events'])} events, metadata {json.dumps(d['metadata'])}")
    for kind in ("allocations", "globals"):
        for e in d[kind]:
            print(f"  {kind[:-1]:<10} {e['address']:#x}  {human(e['size']):>12}  {len(e['chunks'])} chunks"
                  + (f"  {e['name']}" if "name" in e else ""))
    return 0


def ctx_kill(opts):
    call(stub(opts.server).KillContext, pb.KillContextRequest(ctx=opts.ctx))
    print(json.dumps({"killed": opts.ctx}) if opts.json else f"context {opts.ctx} killed")
    return 0


def add_commands(sub, default_server):
    def common(p):
        p.add_argument("--server", default=default_server(), help="the server's address (default $PHOS_SERVER)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("ctx", help="contexts on a server")
    ctx_sub = p.add_subparsers(dest="ctx_command", required=True)
    p = ctx_sub.add_parser("list", help="list the contexts")
    common(p)
    p.set_defaults(func=ctx_list)

    p = ctx_sub.add_parser("kill", help="end a context now, even mid-kernel; it is not restored")
    p.add_argument("ctx", type=int)
    common(p)
    p.set_defaults(func=ctx_kill)

    p = sub.add_parser("checkpoint", help="checkpoint a context into an image store directory (CTX DIR), or a "
                       "whole process, CPU and GPU state, into a new directory (--pid PID DIR)")
    p.add_argument("args", nargs="+", metavar="CTX DIR | DIR")    # DIR: named from here, the server is elsewhere
    p.add_argument("--pid", type=int, help="checkpoint this process whole (CRIU for its CPU state, phos for its "
                   "contexts); it stops, as with `criu dump`, unless --leave-running")
    p.add_argument("--leave-running", action="store_true", help="with --pid: the process goes on afterwards")
    p.add_argument("--shell-job", action="store_true", help="with --pid: the process runs on a terminal (CRIU's --shell-job)")
    p.add_argument("--gpu-store", metavar="STORE", help="with --pid: the contexts' images go into this image store "
                   "(the server's --host-store: pinned memory) instead of DIR/gpu")
    p.add_argument("--pause", action="store_true", help="stop the world instead of copying while the application runs")
    p.add_argument("--incremental", action="store_true", help="copy only what changed since the context's latest image in DIR")
    p.add_argument("--compress", action="store_true", help="zstd the chunks")
    p.add_argument("--name", help="image name (default ctx<ID>-<UTC time>)")
    p.add_argument("--chunk-size", type=int, default=0, help="bytes per chunk (default 2 MiB)")
    p.add_argument("--rate", type=byte_size, default=0, metavar="BYTES",
                   help="copy at most this much a second (e.g. 8G): the checkpoint takes longer, and the "
                   "application keeps more of its speed meanwhile (default: as fast as it goes)")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    common(p)
    p.set_defaults(func=checkpoint)

    p = sub.add_parser("restore", help="restore a context from an image store directory")
    p.add_argument("dir", type=os.path.abspath)    # the server is elsewhere: name it from here
    p.add_argument("--name", help="image name (default: the newest)")
    p.add_argument("--full", action="store_true", help="return once everything is loaded (default: on demand)")
    p.add_argument("--process", action="store_true", help="DIR is a whole process's image (`phos checkpoint --pid`): "
                   "restore its contexts on --server, then the process here with CRIU, attached to them")
    common(p)
    p.set_defaults(func=restore)

    p = sub.add_parser("migrate", help="move a running process whole to another server: its contexts by live "
                       "handoff, then the process by CRIU")
    p.add_argument("pid", type=int)
    p.add_argument("--to", required=True, help="the target server's address")
    p.add_argument("--via", metavar="DIR", help="where the process's image goes on its way (default: a temporary directory)")
    p.add_argument("--remote", metavar="COMMAND", help="a command prefix that runs commands on the target's host "
                   "(`ssh HOST`): the image is sent there as a tar stream and restored by its phos (default: here)")
    p.add_argument("--shell-job", action="store_true", help="the process runs on a terminal (CRIU's --shell-job)")
    common(p)
    p.set_defaults(func=migrate)

    p = sub.add_parser("handoff", help="move a live context to another server (on this host, or tcp://HOST:PORT), "
                       "or to another device of its server")
    p.add_argument("ctx", type=int)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", help="the target server's address")
    where.add_argument("--to-device", type=int, metavar="N", help="another device of the context's server "
                       "(as its applications number them)")
    p.add_argument("--to-key", metavar="FILE", help="a tcp:// target's public key file (its server.key), when it "
                   "is not the source server's own (servers sharing one --auth-dir)")
    p.add_argument("--rounds", type=int, default=0, help="pre-copy rounds at most (default 12)")
    p.add_argument("--chunk-mb", type=int, default=0, help="the rounds' chunk size in MiB (default 2)")
    common(p)
    p.set_defaults(func=handoff)

    p = sub.add_parser("image", help="images")
    img_sub = p.add_subparsers(dest="image_command", required=True)
    p = img_sub.add_parser("inspect", help="show an image's manifest (verified)")
    p.add_argument("dir", type=os.path.abspath)    # the server is elsewhere: name it from here
    p.add_argument("--name", help="image name (default: the newest)")
    common(p)
    p.set_defaults(func=image_inspect)
