"""The control plane's encoding (schema/control_socket.py, ControlRequest and ControlReply in
schema/admin.proto) and the import boundaries it allows: the server imports no client code,
the command line no server code."""
import subprocess
import sys

import pytest

from phos.base import settings
from phos.schema import admin_pb2 as pb
from phos.schema import control_socket, wire
from phos.schema.control import admin_socket, checkpoint_message, checkpoint_result
from phos.schema.cuda_types import CUresult
from phos.snapshot.image import ImageError, encode_delta, read_delta

RESULT = {"name": "ctx1-x", "bytes": 8 << 20, "copied_bytes": 4 << 20, "stored_bytes": 3 << 20, "new_chunks": 2,
          "reused_chunks": 2, "seconds": 0.012345, "mode": "concurrent", "paused": False, "pause_ms": 0.25,
          "recopied_chunks": 0, "cut_seq": 41, "manifest_bytes": 900, "phase_ms": {"cut": 0.5, "copy": 9.0, "commit": 1.25},
          "trace_ms": [[0.0, "cut", 0.5], [0.5, "copy", 9.0]], "trace_from": 1234.5,
          "messages_served": {"before": [5, 0.125], "during": [3, 0.5]}}
DELTA = encode_delta("b", "a", 9, "ab" * 16, 4100, {"status": 0, "message": ""}, [[0x7000_0000, 3, "cd" * 16],
                                                                                    [0x7020_0000, 0, "ef" * 16]])


def fields(message):
    """A message's fields, set or not, as a dict."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def test_requests_round_trip():
    cases = [(pb.ControlAttachRequest(ctx=7, token=b"t" * 16), {"ctx": 7, "token": b"t" * 16}),
             (pb.WorkerCheckpointRequest(store="/s", name="n", paused=True, chunk_size=1 << 20, early=True),
              {"store": "/s", "name": "n", "parent": "", "paused": True, "compress": False, "chunk_size": 1 << 20,
               "freeze": False, "precopy": False, "no_sync": False, "early": True, "rate": 0}),
             (pb.WorkerCheckpointRequest(store="/s", name="n", rate=8 << 30),
              {"store": "/s", "name": "n", "parent": "", "paused": False, "compress": False, "chunk_size": 0,
               "freeze": False, "precopy": False, "no_sync": False, "early": False, "rate": 8 << 30}),
             (pb.RestoreRequest(store="/s", name="b", advance=True, full=True, delta=DELTA),
              {"store": "/s", "name": "b", "full": True, "advance": True, "warm": False, "ctx": 0,
               "delta": DELTA}),
             (pb.RestoreRequest(store="/s", name=""), {"store": "/s", "name": "", "full": False, "advance": False,
                                                       "warm": False, "ctx": 0, "delta": b""}),
             (pb.RetireRequest(to=pb.Destination(endpoint="ipc:///w", standby="ipc:///s", server_key="k" * 40)),
              {"to": pb.Destination(endpoint="ipc:///w", standby="ipc:///s", server_key="k" * 40)}),
             (pb.MovingToRequest(to=pb.Destination(endpoint="tcp://b:7", standby="", server_key="k" * 40)),
              {"to": pb.Destination(endpoint="tcp://b:7", standby="", server_key="k" * 40)}),
             (pb.TenantRequest(name="ab" * 32), {"name": "ab" * 32}),
             (pb.PaceRequest(hold=0.75), {"hold": 0.75}), (pb.KeepContextRequest(seconds=600.0), {"ctx": 0, "seconds": 600.0}),
             (pb.CtxStatsRequest(), {}), (pb.ThawRequest(), {})]
    verbs = ["attach", "checkpoint", "checkpoint", "restore", "restore", "retire_to", "moving_to", "tenant", "pace",
             "keep", "ctx_stats", "thaw"]
    for seq, ((request, read), verb) in enumerate(zip(cases, verbs), 1):
        got_seq, got_verb, got = control_socket.read_request(control_socket.request_frame(seq, request))
        assert (got_seq, got_verb) == (seq, verb)
        assert fields(got) == read, verb
    with pytest.raises(ValueError, match="no control request"):
        control_socket.request_frame(1, pb.CheckpointResult())


def test_replies_round_trip():
    restored = pb.RestoreReply(ctx=7, cut_seq=41, name="b", bytes=1 << 30, loaded=0, phase_ms={"manifest": 0.5, "device": 2.0})
    stats = pb.CtxStats(bytes=4096, allocations=2, last_seq=41, checkpointing=True, restoring=False, done_bytes=1,
                        total_bytes=2)
    result = checkpoint_message(RESULT)
    cases = [("done", None, None), ("failed", (CUresult.CUDA_ERROR_ILLEGAL_STATE, "checkpoint: no"), (401, "checkpoint: no")),
             ("progress", pb.CheckpointProgress(done_bytes=1, total_bytes=2), pb.CheckpointProgress(done_bytes=1, total_bytes=2)),
             ("checkpointed", result, result), ("restored", restored, restored),
             ("stats", stats, stats), ("stats", pb.CtxStats(first_call_loaded=0), pb.CtxStats(first_call_loaded=0))]
    for seq, (kind, value, read) in enumerate(cases, 1):
        assert control_socket.read_reply(control_socket.reply_frame(seq, value)) == (seq, kind, read), kind
    assert control_socket.read_reply(control_socket.reply_frame(1, stats))[2].HasField("first_call_loaded") is False
    assert control_socket.read_reply(control_socket.reply_frame(1, cases[-1][1]))[2].HasField("first_call_loaded")
    assert checkpoint_result(control_socket.read_reply(control_socket.reply_frame(1, result))[2]) == RESULT


def test_a_delta_travels_as_its_message():
    """A checkpoint's delta (an ImageDelta message of schema/image.capnp) reaches the front end as
    its bytes, passed on as they are (the admin API's RestoreRequest.delta) and read only by the
    worker that advances by it (snapshot/image.py read_delta), which refuses bytes that are no delta."""
    _, kind, packed = control_socket.read_reply(control_socket.reply_frame(3, DELTA))
    assert kind == "delta" and packed == DELTA and read_delta(packed, "b").changes[1] == (0x7020_0000, 0, "ef" * 16)
    _, _, request = control_socket.read_request(control_socket.request_frame(4, pb.RestoreRequest(store="/s", name="b",
                                                                                                  delta=packed)))
    assert request.delta == DELTA
    with pytest.raises(ImageError, match="not an ImageDelta"):
        read_delta(b"{", "b")


def test_malformed_control_frames_raise():
    for frame in (b"", b"\x00" * 3, wire.encode_request([(1, "ctxSynchronize", None, None)])[0]):
        try:
            control_socket.read_request(frame)
        except control_socket.MALFORMED:
            pass
        with pytest.raises(control_socket.MALFORMED):
            control_socket.read_reply(b"\x01" * 5)
    with pytest.raises(control_socket.MALFORMED):
        control_socket.read_request(b"\x00" * (control_socket.MAX_FRAME + 1))


def test_checkpoint_result_through_the_admin_api():
    """The worker's result dict, as the admin API carries it, is the dict `--json` prints."""
    msg = pb.CheckpointProgress.FromString(pb.CheckpointProgress(finished=True, result=checkpoint_message(RESULT))
                                           .SerializeToString())
    assert checkpoint_result(msg.result) == RESULT
    assert list(checkpoint_result(msg.result)) == list(RESULT)     # the keys, in the worker's order


def test_no_snapshot_calls_on_the_data_plane():
    calls = set(wire.phos_capnp.Call.schema.union_fields)
    assert not calls & {"checkpoint", "restore", "ctxStats", "ctx_stats", "thaw", "retireTo", "retire_to", "unusedRetire",
                        "movingTo", "moving_to", "keep"}
    assert set(control_socket.VERBS.values()) == {"attach", "checkpoint", "restore", "ctx_stats", "thaw", "retire_to",
                                                  "tenant", "pace", "moving_to", "keep"}


def test_admin_socket():
    assert admin_socket("ipc:///tmp/p/phos.sock") == "unix:/tmp/p/phos.sock.admin"
    assert admin_socket("tcp://127.0.0.1:5555") == f"unix:{settings.socket_directory()}/admin-5555.sock"
    with pytest.raises(ValueError):
        admin_socket("udp://x")


def loaded_by(statement):
    code = f"import sys\n{statement}\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('phos.'))))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("module", ["phos.admin_cli", "phos.cli"])
def test_the_command_line_loads_no_server_code(module):
    modules = loaded_by(f"import {module}")
    assert not [m for m in modules if m.startswith(("phos.gpu_server", "phos.snapshot", "phos.client_stub"))], modules


def test_the_server_loads_no_client_code():
    modules = loaded_by("import phos.gpu_server.control.frontend, phos.gpu_server.control.admin, phos.gpu_server.worker.loop, "
                        "phos.gpu_server.control.handoff")
    assert not [m for m in modules if m.startswith("phos.client_stub")], modules


def test_admin_does_not_import_the_front_end():
    """No import cycle: the front end starts the admin API, which gets the front end as a value."""
    assert "phos.gpu_server.control.frontend" not in loaded_by("import phos.gpu_server.control.admin")


def test_no_server_module_imports_the_client():
    """Not even lazily, inside a function: scanned in the source."""
    import ast
    import pathlib
    root = pathlib.Path(wire.__file__).resolve().parent.parent / "gpu_server"
    found = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if "client_stub" in n]
    assert not found, found


# -- a checkpoint whose worker went away: what is true is reported ---------------------------------

class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, details):
        raise _Aborted(details)


def _failed_checkpoint(tmp_path, commit_first):
    """Admin.Checkpoint against a front end whose worker goes away mid-checkpoint, after it
    committed its image (commit_first) or after it stored only some chunks."""
    import asyncio
    import types
    from test_snapshot_image import make_contents, write_image
    from phos.gpu_server.control.admin import Admin
    from phos.schema import admin_pb2 as pb
    from phos.schema.cuda_types import CudaError, CUresult
    from phos.snapshot import DirStore, ImageWriter
    store = DirStore(tmp_path / "store")

    async def checkpoint(worker, request, on_progress=None, on_delta=None):
        store, name = request.store, request.name
        if commit_first:
            write_image(DirStore(store), name, make_contents())      # its session names context 7
        else:
            writer = ImageWriter(DirStore(store), name)
            writer.add_region(make_contents()[0x7F0000000000][:1 << 16])
            writer.close()                                          # killed: no abort, no commit
        raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, "checkpoint: the context's worker went away")
    front = types.SimpleNamespace(workers={7: types.SimpleNamespace(ctx_id=7, proc=types.SimpleNamespace(returncode=None))},
                                  checkpoint=checkpoint, counts={})

    async def run():
        request = pb.CheckpointRequest(ctx=7, store=str(tmp_path / "store"), name="img")
        async for _ in Admin(front).Checkpoint(request, _Context()):
            pass
    with pytest.raises(_Aborted) as e:
        asyncio.run(run())
    return str(e.value), store


def test_a_checkpoint_whose_worker_died_after_committing_says_its_image_is_whole(tmp_path):
    message, store = _failed_checkpoint(tmp_path, commit_first=True)
    assert "went away" in message and "image 'img' had been committed" in message, message
    assert store.list_images() == ["img"]


def test_a_checkpoint_whose_worker_died_before_committing_leaves_nothing(tmp_path):
    message, store = _failed_checkpoint(tmp_path, commit_first=False)
    assert "went away" in message and "committed" not in message, message
    assert store.list_images() == [] and store.list_chunks() == []
