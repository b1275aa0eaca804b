"""One definition of every setting, of the staging area's layout and of the default server.

phos/base/settings.py declares every PHOS_* variable; README.md's "Settings" table is generated
from it; the Python product code and the native stub read them nowhere else; and the
staging layout and the default server are schema/phos.capnp constants both sides use.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from phos.base import settings
from phos.schema import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("gpu_server", "client_stub", "snapshot", "phos", "schema")
NATIVE = ROOT / "client_stub" / "native"


def product_python():
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if path != ROOT / "phos" / "base" / "settings.py" and "tools" not in path.relative_to(ROOT).parts:
                yield path


def native_sources():
    return sorted(p for p in NATIVE.glob("*") if p.suffix in (".cpp", ".h"))


def test_readme_table_is_the_declarations():
    readme = (ROOT / "README.md").read_text()
    assert "\n## Settings\n" in readme, "README.md has no `## Settings` section"
    section = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    start = section.index("| Variable |")
    table = "".join(line + "\n" for line in section[start:].splitlines() if line.startswith("|"))
    assert table == settings.markdown_table(), "README.md's Settings table drifted: paste `python -m phos.base.settings`"


def test_each_variable_is_declared_once():
    names = [s.name for s in settings.TABLE]
    assert len(names) == len(set(names)) and all(n.startswith("PHOS_") for n in names)
    assert all(s.meaning and s.readers for s in settings.TABLE)


def test_python_reads_no_phos_variable_outside_settings():
    read = re.compile(r"""(environ\b[^\n]*|getenv\()\s*\(?\s*["']PHOS_""")
    stray = [f"{p.relative_to(ROOT)}:{n}" for p in product_python()
             for n, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert not stray, f"PHOS_* read outside phos/base/settings.py: {stray}"


def test_every_variable_python_names_is_declared():
    named = set()
    for p in product_python():
        named |= set(re.findall(r"\bsettings\.([a-z_]+)(?:\(|\.raw\()", p.read_text()))
    declared = {k for k, v in vars(settings).items() if isinstance(v, settings.Setting)}
    assert named - {"default_server", "socket_directory", "use_client_keys", "TABLE", "BY_NAME"} <= declared


def test_the_stub_reads_its_variables_in_settings_cpp_alone():
    stray = [f"{p.name}:{n}" for p in native_sources() if p.name != "settings.cpp"
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bgetenv\s*\(", line)]
    assert not stray, f"getenv outside client_stub/native/settings.cpp: {stray}"
    read = set(re.findall(r'"(PHOS_[A-Z_]+)"', (NATIVE / "settings.cpp").read_text()))
    declared = {s.name for s in settings.TABLE if settings.STUB in s.readers.split(", ")}
    assert read == declared, f"stub reads {sorted(read - declared)} undeclared; declared for it, unread: {sorted(declared - read)}"


def test_the_stub_defaults_are_the_declared_ones():
    source = (NATIVE / "settings.cpp").read_text()
    checked = 0
    for name, default in re.findall(r'env_(?:seconds|long)\("(PHOS_[A-Z_]+)", ([^)?]+)\)', source):
        want = settings.BY_NAME[name].default
        if callable(want):
            continue
        assert eval(default.replace("L <<", " <<")) == want, (name, default, want)   # C literals: 5.0, 1 << 20, 256L << 20
        checked += 1
    assert checked >= 10


def test_spin_default_is_the_same_on_both_sides():
    source = (NATIVE / "settings.cpp").read_text()
    assert 'env_long("PHOS_SPIN_US", cores > 4 ? 1000 : 0)' in source
    assert settings.BY_NAME["PHOS_SPIN_US"].default() == (1000.0 if (os.cpu_count() or 1) > 4 else 0.0)


def test_settings_are_read_when_asked(monkeypatch):
    monkeypatch.delenv("PHOS_SERVER", raising=False)
    assert settings.server() == settings.default_server()
    monkeypatch.setenv("PHOS_SERVER", "ipc:///elsewhere")
    assert settings.server() == "ipc:///elsewhere"
    monkeypatch.setenv("PHOS_SERVER", "")
    assert settings.server() == settings.default_server() and settings.server.raw() is None
    monkeypatch.setenv("PHOS_STAGING", "0")
    assert settings.staging() is False
    monkeypatch.setenv("PHOS_STAGING", "auto")
    assert settings.staging() is None
    monkeypatch.setenv("PHOS_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PHOS_CONNECT_TIMEOUT"):
        settings.connect_timeout()


def test_reattach_timeout_is_the_clients_and_restore_grace_the_workers():
    code = ("from phos.gpu_server.worker import control as worker; from phos.client_stub import connection; "
            "print(worker.REATTACH_TIMEOUT, connection.REATTACH_TIMEOUT)")
    env = {k: v for k, v in os.environ.items() if k not in ("PHOS_REATTACH_TIMEOUT", "PHOS_RESTORE_GRACE")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PHOS_REATTACH_TIMEOUT="7"),
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["60.0", "7.0"]
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PHOS_RESTORE_GRACE="5"),
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["5.0", "60.0"]


# -- the staging area's layout and the default server: schema/phos.capnp constants ----------------

LAYOUT = {"COOKIE_BYTES": "stagingCookieBytes", "AWAKE_OFFSET": "stagingAwakeOffset",
          "ASLEEP_OFFSET": "stagingAsleepOffset", "BOX_OFFSET": "stagingBoxOffset", "BOX_SIZE": "stagingBoxSize",
          "SLOTS_OFFSET": "stagingSlotsOffset", "SLOT_SIZE": "stagingSlotSize", "MIN_COPY": "stagingMinCopy"}


def test_python_layout_is_the_schemas():
    for name, const in LAYOUT.items():
        assert getattr(wire, name) == getattr(wire.phos_capnp, const), name
    assert wire.SLOTS_OFFSET == wire.BOX_OFFSET + 2 * wire.BOX_SIZE
    assert wire.ASLEEP_OFFSET + 8 <= wire.BOX_OFFSET and wire.COOKIE_BYTES <= wire.AWAKE_OFFSET
    from phos.client_stub import connection
    assert (connection.STAGING_SLOT, connection.STAGING_MIN) == (wire.SLOT_SIZE, wire.MIN_COPY)


def test_the_stub_layout_is_the_schemas():
    """The stub takes each value from the generated header (no number of its own), and the header
    holds the values pycapnp reads."""
    source = (NATIVE / "session.cpp").read_text()
    block = source.split("namespace staging {", 1)[1].split("}  // namespace staging", 1)[0]
    values = dict(re.findall(r"size_t (k\w+) = ([^;]+);", block))
    assert values, "session.cpp: no staging layout"
    for k, v in values.items():
        assert "::STAGING_" in v or k == "kAreaSize", f"session.cpp: {k} = {v} is not the schema's"
    for p in native_sources():
        assert not re.search(r"\bk(BoxOffset|BoxSize|SlotsOffset|SlotSize|MinCopy|CookieBytes)\s*=\s*\d", p.read_text()), p
    header = NATIVE / "build" / "phos.capnp.h"
    if not header.exists():
        pytest.skip("the native stub is not built (make -C client_stub/native)")
    consts = {k: int(v) for k, v in re.findall(r"constexpr\s+::uint64_t (STAGING_\w+) = (\d+)llu;", header.read_text())}
    for name, const in LAYOUT.items():
        assert consts["STAGING_" + name] == getattr(wire.phos_capnp, const), name


def test_default_server_is_defined_once():
    """The socket's name is a schema constant; the directory rule is settings.socket_directory()
    in Python and the same rule in the stub's settings.cpp: both name the same address."""
    assert settings.default_server() == f"ipc://{settings.socket_directory()}/{wire.phos_capnp.defaultSocket}"
    literal = f'"{wire.phos_capnp.defaultSocket}"'
    sources = list(product_python()) + native_sources() + [ROOT / "phos" / "base" / "settings.py"]
    assert not [str(p.relative_to(ROOT)) for p in sources if literal in p.read_text()]
    assert "::DEFAULT_SOCKET" in (NATIVE / "settings.cpp").read_text()
    lib = ROOT / "phos" / "stub" / "libcuda.so.1"
    if not lib.exists():
        pytest.skip("the native stub is not built")
    for env in ({}, {"XDG_RUNTIME_DIR": "/nonexistent/run"}):
        full = {k: v for k, v in os.environ.items() if k not in ("PHOS_SERVER", "XDG_RUNTIME_DIR")}
        full.update(env, PHOS_CONNECT_TIMEOUT="0.2")
        code = f"import ctypes; ctypes.CDLL({str(lib)!r}).cuInit(0); from phos.base import settings; print(settings.default_server())"
        r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)
        assert f"no phos server answered at {r.stdout.strip()} " in r.stderr, (r.stdout, r.stderr)


@pytest.mark.skipif(os.geteuid() != 0, reason="root's socket directory")
def test_roots_socket_directory_is_fixed(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    assert settings.socket_directory() == "/run/phos"