"""The interfaces in code: Backend (gpu_server/backends/backend.py), SnapshotOps and SnapshotSession
(snapshot/ops.py), HandoffSource and HandoffTarget (gpu_server/control/handoff_parties.py). emu's
classes, the worker's Session and the handoff's targets are checked as objects; the cuda backend's
modules cannot be imported without a GPU driver, so their classes are checked in their source, as
the front end's is (it is made with a server's sockets)."""
import ast
import inspect
import os

import pytest

from phos.gpu_server.backends.backend import Backend
from phos.gpu_server.control.handoff_parties import HandoffSource, HandoffTarget
from phos.snapshot.ops import SnapshotOps, SnapshotSession

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def members(proto):
    """{name: function, or None for an attribute} of a Protocol's own members."""
    out = {name: None for name in getattr(proto, "__annotations__", {})}
    for name, value in vars(proto).items():
        if name.startswith("_"):
            continue
        if isinstance(value, staticmethod):
            value = value.__func__
        if isinstance(value, property):
            out[name] = None          # an attribute, however it is provided
        elif inspect.isfunction(value):
            out[name] = value
    return out


def parameters(fn):
    """A function's parameters after self, as (name, kind, default)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def check(obj, proto):
    assert isinstance(obj, proto), f"{type(obj).__name__} is not a {proto.__name__}"
    for name, fn in members(proto).items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {proto.__name__}.{name}"
        if fn is not None:
            got = inspect.getattr_static(type(obj), name)
            got = got.__func__ if isinstance(got, staticmethod) else got
            assert parameters(got) == parameters(fn), f"{type(obj).__name__}.{name}{inspect.signature(got)} " \
                                                       f"differs from {proto.__name__}.{name}{inspect.signature(fn)}"


def test_the_protocols_declare_their_members():
    assert {"name", "pins_host_memory", "space", "snap", "devices", "alloc", "launch", "close"} <= set(members(Backend))
    assert set(members(SnapshotOps)) == {"map_ahead", "freeze", "release", "fingerprints", "read", "write", "maps", "pin", "prepare",
                                         "threads_at_work"}
    assert {"backend", "space", "listing", "note", "load_module", "place", "lookup", "reach_global", "state", "adopt"} == \
        set(members(SnapshotSession))
    for proto in (Backend, SnapshotOps, SnapshotSession):
        for name, fn in members(proto).items():
            assert fn is None or fn.__doc__, f"{proto.__name__}.{name} has no docstring"


def test_emu_provides_every_member():
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    backend = EmuBackend()
    check(backend, Backend)
    check(backend.snap, SnapshotOps)
    check(Session(backend, 1, b"t" * 16), SnapshotSession)


def test_a_session_keeps_its_state_through_the_interface():
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    s = Session(EmuBackend(), 3, b"t" * 16)
    sess, error = s.state()
    assert sess == {"ctx": 3, "token": s.token_digest, "next_id": s.next_id} and error == {"status": 0, "message": ""}
    s.place(0x2000, "stream", "a stream", {"flags": 1, "priority": 0})
    s.note(0x2000, {"seen": True})
    assert s.listing() == [(0x2000, "stream", "a stream", {"flags": 1, "priority": 0, "seen": True})]
    assert s.lookup("stream", 0x2000) == "a stream"
    s.adopt({"ctx": 9, "token": "ab" * 32, "next_id": 0x3000}, {"status": 700, "message": "illegal address"})
    assert s.state() == ({"ctx": 9, "token": "ab" * 32, "next_id": 0x3000}, {"status": 700, "message": "illegal address"})
    assert s.sticky == (700, "illegal address")


def classes(path):
    """{name: ClassDef} of the classes a source file (path from the repository's root) declares."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}


def declared(cls):
    """{name: FunctionDef, or None for an attribute} that a class's source declares: its
    methods and properties, its class attributes, and what __init__ sets on self."""
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            prop = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            out[node.name] = None if prop else node
            if node.name == "__init__":
                for n in ast.walk(node):
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []):
                        for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                                out.setdefault(e.attr, None)
        elif isinstance(node, ast.Assign):
            out.update((t.id, None) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def ast_parameters(fn):
    """parameters() of a function's source."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    kinds = [inspect.Parameter.POSITIONAL_ONLY] * len(a.posonlyargs) + [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(a.args)
    out = [(p.arg, k, d) for p, k, d in zip(positional, kinds, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    out += [(p.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else ast.literal_eval(d))
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return out[1:] if out and out[0][0] == "self" else out


@pytest.mark.parametrize("path, cls, proto", [("gpu_server/backends/cuda.py", "CudaBackend", Backend),
                                              ("gpu_server/backends/cuda_snapshot.py", "CudaSnapshotOps", SnapshotOps),
                                              ("gpu_server/control/frontend.py", "FrontEnd", HandoffSource)])
def test_a_class_checked_in_its_source_declares_every_member(path, cls, proto):
    have = declared(classes(path)[cls])
    for name, fn in members(proto).items():
        assert name in have, f"{path}'s {cls} lacks {proto.__name__}.{name}"
        if fn is not None:
            assert have[name] is not None, f"{path}'s {cls}.{name} is not a method"
            assert ast_parameters(have[name]) == parameters(fn), f"{path}'s {cls}.{name} differs from {proto.__name__}.{name}"


def test_the_handoffs_parties_declare_their_members():
    assert set(members(HandoffSource)) == {"host_store", "moved", "counts", "checkpoint", "ctx_stats", "thaw", "pace",
                                           "retire", "moving_to", "worker_alive"}
    assert set(members(HandoffTarget)) == {"same_server", "remote", "stats", "send", "restore", "drop_warm", "wait_loaded"}
    for proto in (HandoffSource, HandoffTarget):
        for name, fn in members(proto).items():
            assert fn is None or fn.__doc__, f"{proto.__name__}.{name} has no docstring"


def test_every_handoff_target_provides_every_member():
    """The three targets a handoff has (admin.py picks one), made as admin.py makes them: making
    one opens nothing."""
    from phos.gpu_server.control.handoff import DeviceTarget
    from phos.gpu_server.control.handoff_net import RemoteTarget
    from phos.gpu_server.control.handoff_target import TargetServer
    for target in (TargetServer("unix:/nowhere", 7, "there"), RemoteTarget("tcp://there:7", 7, (b"t", b"p", b"s")),
                   DeviceTarget(None, 7, 1)):
        check(target, HandoffTarget)


def test_no_backend_is_told_by_its_name():
    """A backend's abilities are Protocol members (pins_host_memory), not checks of its name."""
    for path in ("gpu_server/worker/loop.py", "gpu_server/worker/control.py", "gpu_server/worker/main.py",
                 "gpu_server/worker/session.py", "gpu_server/worker/calls.py", "snapshot/engine.py"):
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ("cuda", "emu")
                                                     for c in [node.left, *node.comparators]):
                pytest.fail(f"{path}:{node.lineno} compares with a backend's name")
