"""NVIDIA's own runtime on phos's driver: programs whose RPATH pins NVIDIA's libcudart.so.13
(as PyTorch's wheels pin theirs) run with LD_LIBRARY_PATH=phos/stub against an emu server,
so everything they do reaches phos through libcuda.so.1: the export tables, cuGetProcAddress,
library loading, occupancy, cooperative launches, stream-ordered allocation, captured graphs
and host functions (tests/apps/runtime_features.cu), graphs built node by node
(tests/apps/graph_nodes.cu), and managed and mapped host memory (tests/apps/managed_memory.cu).

NVIDIA's runtime comes from the nvidia-cuda-runtime wheel (scripts/setup.sh installs it), or
else from the CUDA toolkit; the tests skip when neither is there.
"""
import ctypes
import glob
import os
import subprocess
import sys
import pytest

from test_stub import APPS, CUDA_HOME, KERNEL_APPS, LIBCUDA, NVCC, stub_env

RUNTIME_INTERFACE = bytes.fromhex("6bd5fb6c5bf4e74a8987d93912fd9df9")
INTEGRITY_CHECK = bytes.fromhex("d4082055bde6704b8d34ba123c66e1f2")


def nvidia_runtime_dir():
    """The folder of NVIDIA's libcudart.so.13: the wheel's, else the toolkit's."""
    try:
        import nvidia
        for root in nvidia.__path__:
            for lib in glob.glob(os.path.join(root, "cu13", "lib", "libcudart.so.13")):
                return os.path.dirname(lib)
    except ImportError:
        pass
    lib = os.path.join(CUDA_HOME, "lib64", "libcudart.so.13")
    return os.path.dirname(os.path.realpath(lib)) if os.path.exists(lib) else None


@pytest.fixture(scope="session")
def pinned_apps(stub, tmp_path_factory):
    """tests/apps built with NVIDIA's runtime pinned by RPATH."""
    runtime = nvidia_runtime_dir()
    if runtime is None:
        pytest.skip("NVIDIA's libcudart.so.13 not found (pip install nvidia-cuda-runtime)")
    if not os.path.exists(NVCC):
        pytest.skip("nvcc not found: cannot build the CUDA test programs")
    out = tmp_path_factory.mktemp("pinned-apps")
    r = subprocess.run(["sh", os.path.join(APPS, "build_apps.sh"), str(out)], capture_output=True, text=True,
                       env=dict(os.environ, PHOS_APPS_RPATH=runtime))
    assert r.returncode == 0, f"building tests/apps failed:\n{r.stdout}\n{r.stderr}"
    return out


def run_pinned(apps, server, app):
    return subprocess.run([str(apps / app)], capture_output=True, text=True, timeout=300,
                          env=stub_env(server.address, PHOS_VERBOSE="1"))


def test_the_programs_are_pinned_to_nvidias_runtime(pinned_apps):
    dynamic = subprocess.run(["readelf", "-d", str(pinned_apps / "vector_add")], capture_output=True, text=True).stdout
    assert f"Library rpath: [{nvidia_runtime_dir()}]" in dynamic


@pytest.mark.parametrize("app", KERNEL_APPS + ["runtime_features", "graph_nodes", "managed_memory"])
def test_program_runs_on_nvidias_runtime(pinned_apps, server, app):
    r = run_pinned(pinned_apps, server, app)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), f"{r.stdout}\n{r.stderr}"
    assert "wrong=0" in r.stdout
    # Only NVIDIA's runtime asks for the driver's private tables: it, not phos's, ran.
    assert "cuGetExportTable: runtime interface" in r.stderr
    assert "unsupported CUDA call" not in r.stderr, r.stderr


def test_the_runtime_features_each_report(pinned_apps, server):
    out = run_pinned(pinned_apps, server, "runtime_features").stdout
    for line in ("cooperative: wrong=0", "entry point: found=1 wrong=0", "stream-ordered allocation: wrong=0 in use>0=1",
                 "graph: capturing=1 wrong=0 replays=3 nodes=3", "host function: ran=1", "occupancy: blocks per SM>0=1",
                 "profiler: start=0 stop=0"):
        assert line in out, out


def test_a_graph_built_node_by_node_runs_in_dependency_order(pinned_apps, server):
    """tests/apps/graph_nodes.cu: cudaGraphCreate and cudaGraphAdd*Node with dependencies; its
    host node checks each launch's result in this process, with input changed between launches."""
    r = run_pinned(pinned_apps, server, "graph_nodes")
    for line in ("graph: nodes=9 roots=2 combine deps=3", "launches: runs=3 wrong=0", "exec set params: runs=4 wrong=0",
                 "clone: runs=5 wrong=0", "child graph: nonzero=0", "captured host copies: wrong=0"):
        assert line in r.stdout, f"{r.stdout}\n{r.stderr}"


def test_managed_and_mapped_memory_are_used_in_place(pinned_apps, server):
    """tests/apps/managed_memory.cu: the application's pages, which the worker maps at the same
    addresses: kernels update what the host wrote (pointers stored in it included), and the
    host sees it after a synchronisation."""
    r = run_pinned(pinned_apps, server, "managed_memory")
    for line in ("managed memory attribute: 1", "managed: wrong=0 type managed=1", "linked list: sum=55",
                 "managed copies: wrong=0", "mapped host memory: wrong=0 same address=1",
                 "registered mapped memory: wrong=0 same address=1 mapped flag=1"):
        assert line in r.stdout, f"{r.stdout}\n{r.stderr}"
    assert "for the device to use in place" in r.stderr


# -- the tables themselves, asked directly ---------------------------------------------------

ASK_TABLE = """
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
table = ctypes.c_void_p()
err = cuda.cuGetExportTable(ctypes.byref(table), ctypes.c_char_p(bytes.fromhex(sys.argv[2])))
print(err, ctypes.c_size_t.from_address(table.value).value if table.value else 0)
"""


def ask_table(uuid_hex):
    """cuGetExportTable's answer for the id, and the table's first slot (0: no table)."""
    r = subprocess.run([sys.executable, "-c", ASK_TABLE, LIBCUDA, uuid_hex], capture_output=True, text=True, timeout=60)
    err, first_slot = r.stdout.split()
    return int(err), int(first_slot), r.stderr


def test_an_unknown_table_is_refused_by_its_id(stub):
    err, first_slot, stderr = ask_table("00112233445566778899aabbccddeeff")
    assert (err, first_slot) == (1, 0)     # CUDA_ERROR_INVALID_VALUE, and no table
    assert "unsupported CUDA export table {00112233-4455-6677-8899-aabbccddeeff}" in stderr


def test_the_runtime_interface_states_its_size(stub):
    err, first_slot, _ = ask_table(RUNTIME_INTERFACE.hex())
    assert (err, first_slot) == (0, 13 * 8)     # as the H200's driver states it


# -- the integrity check: an HMAC-MD2 that NVIDIA's runtime computes too --------------------

MD2_S = bytes.fromhex(
    "292e43c9a2d87c013d3654a1ecf0061362a705f3c0c7738c98932bd9bc4c82ca1e9b573cfdd4e01667426f188a17e512"
    "be4ec4d6da9ede49a0fbf58ebb2fee7aa968799115b2073f94c210890b225f21807f5d9a5a903227353ecce7bff79703"
    "ff1930b348a5b5d1d75e922aac56aac64fb838d296a47db676fc6be29c7404f1459d705964718720865bcf65e62da802"
    "1b6025adaeb0b9f61c46616934407e0f5547a323dd51af3ac35cf9cebac5ea262c530d6e85288409d3dfcdf441814d52"
    "6adc37c86cc1abfa24e17b080cbdb14a7888958be363e86de9cbd5fe3b001d39f2efb70e6658d0e4a67772f8eb754b0a"
    "314450b48fed1f1adb998d339f118314")


def md2(data):
    """RFC 1319."""
    pad = 16 - len(data) % 16
    data = data + bytes([pad]) * pad
    checksum, last = bytearray(16), 0
    for i in range(0, len(data), 16):
        for j in range(16):
            checksum[j] ^= MD2_S[data[i + j] ^ last]
            last = checksum[j]
    data += bytes(checksum)
    x = bytearray(48)
    for i in range(0, len(data), 16):
        block = data[i:i + 16]
        x[16:32] = block
        x[32:48] = bytes(a ^ b for a, b in zip(x[:16], block))
        t = 0
        for round_ in range(18):
            for k in range(48):
                x[k] ^= MD2_S[t]
                t = x[k]
            t = (t + round_) % 256
    return bytes(x[:16])


def test_md2_matches_rfc_1319():
    assert md2(b"").hex() == "8350e5a3e24c153df2275c9f80692773"
    assert md2(b"abc").hex() == "da853b0d3f88d99b30283a69e6ded6bb"
    assert md2(b"message digest").hex() == "ab4f496bfb2a530b219ff33031fe06b0"


INTEGRITY = """
import ctypes, struct, sys, threading, time, os
cuda = ctypes.CDLL(sys.argv[1])
assert cuda.cuInit(0) == 0
table = ctypes.c_void_p()
for name, uuid in (("integrity", sys.argv[2]), ("runtime", sys.argv[3])):
    t = ctypes.c_void_p()
    assert cuda.cuGetExportTable(ctypes.byref(t), ctypes.c_char_p(bytes.fromhex(uuid))) == 0
    globals()[name] = t.value
check = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_void_p)(
    ctypes.c_void_p.from_address(integrity + 8).value)
out = (ctypes.c_uint64 * 2)()
version, now = int(sys.argv[4]), int(time.time())
assert check(version, now, out) == 0
driver, count = ctypes.c_int(), ctypes.c_int()
cuda.cuDriverGetVersion(ctypes.byref(driver)); cuda.cuDeviceGetCount(ctypes.byref(count))
devices = b""
for d in range(count.value):
    uuid = ctypes.create_string_buffer(16)
    assert cuda.cuDeviceGetUuid_v2(uuid, d) == 0
    ids = []
    for attr in (50, 33, 34):    # PCI domain, bus, device
        v = ctypes.c_int()
        assert cuda.cuDeviceGetAttribute(ctypes.byref(v), attr, d) == 0
        ids.append(v.value)
    devices += uuid.raw + struct.pack("<3i", *ids)
message = struct.pack("<4I3QQ", driver.value, version, os.getpid(), threading.get_ident() & 0xFFFFFFFF,
                      runtime, integrity, ctypes.c_void_p.from_address(integrity + 8).value, now) + devices
print(bytes(out).hex(), message.hex())
"""


def test_the_integrity_check_is_the_hmac_md2_of_process_tables_and_devices(stub, server):
    r = subprocess.run([sys.executable, "-c", INTEGRITY, LIBCUDA, INTEGRITY_CHECK.hex(), RUNTIME_INTERFACE.hex(), "13002"],
                       capture_output=True, text=True, timeout=60, env=stub_env(server.address))
    assert r.returncode == 0, r.stderr
    answer, message = (bytes.fromhex(h) for h in r.stdout.split())
    key = bytes.fromhex("146addae53a9a752aa0841360bf55a9f")
    inner = md2(bytes(k ^ 0x36 for k in key) + message)
    assert answer == md2(bytes(k ^ 0x5C for k in key) + inner)


def test_runtimes_whose_version_ends_in_0_get_the_fixed_answer(stub, server):
    r = subprocess.run([sys.executable, "-c", INTEGRITY, LIBCUDA, INTEGRITY_CHECK.hex(), RUNTIME_INTERFACE.hex(), "13000"],
                       capture_output=True, text=True, timeout=60, env=stub_env(server.address))
    assert r.returncode == 0, r.stderr
    answer = bytes.fromhex(r.stdout.split()[0])
    assert answer == (0x3341181C03CB675C).to_bytes(8, "little") + (0x8ED383AA1F4CD1E8).to_bytes(8, "little")


def test_context_local_storage_answers_as_the_h200s_driver_did(stub, server):
    """perf/probe_context_storage.py on the H200's driver: a missing key is 400, a key keeps its
    first value (a second put is 400), a context check answers 0 and leaves its detail alone."""
    probe = os.path.join(os.path.dirname(APPS), "..", "perf", "probe_context_storage.py")
    r = subprocess.run([sys.executable, probe, LIBCUDA], capture_output=True, text=True, timeout=60,
                       env=stub_env(server.address))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for expected in ("get missing (ctx): 400 None", "delete missing: 400", "put: 0", "put again: 400",
                     "get deleted: 400", "context check: 0 0 77", "check 3: 0"):
        assert expected in lines, r.stdout
    assert lines[lines.index("put again: 400") + 1] == "get: 0 22136"


def test_verbose_2_names_each_call_the_runtime_makes_with_its_result(pinned_apps, server):
    r = subprocess.run([str(pinned_apps / "vector_add")], capture_output=True, text=True, timeout=300,
                       env=stub_env(server.address, PHOS_VERBOSE="2"))
    assert r.returncode == 0, r.stderr
    assert "phos: call cuLibraryGetKernel -> 0" in r.stderr and "phos: call cuLaunchKernel -> 0" in r.stderr


CALL_SLOT = """
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
table = ctypes.c_void_p()
assert cuda.cuGetExportTable(ctypes.byref(table), ctypes.c_char_p(bytes.fromhex(sys.argv[2]))) == 0
slot = ctypes.c_void_p.from_address(table.value + 8 * int(sys.argv[3])).value
print(0 if not slot else ctypes.CFUNCTYPE(ctypes.c_int)(slot)())
"""


@pytest.mark.parametrize("verbose", ["1", "2"])
def test_slots_only_the_driver_fills_name_themselves_when_tracing(stub, verbose):
    """Slot 3 of the runtime interface is filled by NVIDIA's driver, and its meaning is not
    public: empty here, unless PHOS_VERBOSE=2 asks that a call to it be named."""
    r = subprocess.run([sys.executable, "-c", CALL_SLOT, LIBCUDA, RUNTIME_INTERFACE.hex(), "3"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PHOS_VERBOSE=verbose))
    assert r.returncode == 0, r.stderr
    if verbose == "1":
        assert r.stdout.strip() == "0"
    else:
        assert r.stdout.strip() == "801" and "export table call: runtime interface, slot 3" in r.stderr


# -- the context's identity, by which cuBLASLt keys its kernels ------------------------------

TOOLS_TLS = bytes.fromhex("42d85a8123f6cb478298f6e78a3aecdc")
CONTEXT_IDENTITY = bytes.fromhex("21318c6097143248 8ca641ff7324c8f2".replace(" ", ""))
TABLE_1734DC26 = bytes.fromhex("1734dc26800d47458726c0f1e7dd8bca")

IDENTITY = """
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
def table(uuid):
    t = ctypes.c_void_p()
    assert cuda.cuGetExportTable(ctypes.byref(t), ctypes.c_char_p(bytes.fromhex(uuid))) == 0
    return t.value
assert cuda.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
tls, identity = table(sys.argv[2]), table(sys.argv[3])
current = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ctypes.c_void_p.from_address(tls + 16).value)
context_id = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(ctypes.c_void_p.from_address(identity + 32).value)
seen = ctypes.c_void_p()
print("current, none:", current(ctypes.byref(seen)), seen.value)
assert cuda.cuCtxSetCurrent(ctx) == 0
print("current:", current(ctypes.byref(seen)), seen.value == ctx.value)
ours, theirs = ctypes.c_ulonglong(), ctypes.c_ulonglong()
assert cuda.cuCtxGetId(ctx, ctypes.byref(theirs)) == 0
print("id:", context_id(ctx, ctypes.byref(ours)), ours.value == theirs.value)
print("size:", ctypes.c_size_t.from_address(identity).value)
"""


def test_the_tools_table_names_the_current_context_and_the_identity_table_its_id(stub, server):
    """As the H200's driver answers them (perf/probe_export_tables.c and a traced cuBLASLt):
    tools TLS slot 2 writes the current context, context identity slot 4 is cuCtxGetId."""
    r = subprocess.run([sys.executable, "-c", IDENTITY, LIBCUDA, TOOLS_TLS.hex(), CONTEXT_IDENTITY.hex()],
                       capture_output=True, text=True, timeout=60, env=stub_env(server.address))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["current, none: 0 None", "current: 0 True", "id: 0 True", f"size: {93 * 8}"]


def test_the_table_cublaslt_needs_for_nvjet_kernels_fails_each_call_by_name(stub):
    """cuBLASLt crashes when 1734dc26 is missing, and takes another kernel when its calls fail."""
    r = subprocess.run([sys.executable, "-c", CALL_SLOT, LIBCUDA, TABLE_1734DC26.hex(), "4"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "801" and "export table call: 1734dc26, slot 4" in r.stderr


# -- a context of NVIDIA's runtime moves: its library modules, context storage and all -------

@pytest.fixture(scope="module")
def pinned_iterate(stub, tmp_path_factory):
    """tests/apps/iterate.cu with NVIDIA's runtime pinned by RPATH."""
    from test_stub_reattach import APP
    runtime = nvidia_runtime_dir()
    if runtime is None or not os.path.exists(NVCC):
        pytest.skip("NVIDIA's libcudart.so.13 or nvcc not found")
    out = tmp_path_factory.mktemp("pinned-iterate") / "iterate"
    r = subprocess.run([NVCC, "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-gencode",
                        "arch=compute_90,code=sm_90", "-Xlinker", "--disable-new-dtags", "-Xlinker", f"-rpath={runtime}",
                        "-o", str(out), APP],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


def test_a_program_on_nvidias_runtime_is_handed_off_at_a_pause(pinned_iterate, servers):
    from phos.admin_cli import stub as admin
    from phos.schema import admin_pb2 as pb
    from test_stub_reattach import PAUSE, Program, context_of, reference
    one, two = servers("one"), servers("two")
    expected = reference(pinned_iterate, one, PAUSE)
    prog = Program(pinned_iterate, one, PAUSE, PHOS_VERBOSE="1")
    prog.until_ready()
    ctx = context_of(one)
    admin(one.address).Handoff(pb.HandoffRequest(ctx=ctx, to=two.address))
    prog.go_on()
    code, out, err = prog.finish()
    assert code == 0 and out == expected, f"{out}\n{err}\n{two.output()[-4000:]}"
    assert "cuGetExportTable: runtime interface" in err and f"context {ctx} re-attached" in err, err
