"""The native client stub (client_stub/native -> phos/stub): unmodified CUDA programs
run through `phos run` against a real server process, plus the stub's promises about
what it exports, what it needs, and how it fails.

Builds the stub (make is incremental) and the programs in tests/apps with nvcc; skips
when nvcc or the CUDA 13 headers are missing. On the H200 the same tests run against a
`cuda` server with --backend cuda; tests/apps/run_native_vs_stub.sh compares with NVIDIA's.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "client_stub", "native")
STUB = os.path.join(ROOT, "phos", "stub")
APPS = os.path.join(ROOT, "tests", "apps")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
NVCC = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")
LIBCUDA = os.path.join(STUB, "libcuda.so.1")
LIBCUDART = os.path.join(STUB, "libcudart.so.13")


@pytest.fixture(scope="session")
def stub():
    """Builds phos/stub with make (a no-op when it is up to date)."""
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda.h")):
        pytest.skip(f"no CUDA 13 headers under {CUDA_HOME}: the stub cannot be built here")
    r = subprocess.run(["make", "-s", "-C", NATIVE], capture_output=True, text=True)
    if r.returncode != 0 and "client_stub/native: " in r.stderr:   # a build dependency is missing
        if not os.path.exists(LIBCUDART):
            pytest.skip(r.stderr.strip().splitlines()[-1])
        return STUB   # a machine without build tools, with the stub built elsewhere
    assert r.returncode == 0, f"building the native stub failed:\n{r.stdout}\n{r.stderr}"
    return STUB


@pytest.fixture(scope="session")
def apps(stub, tmp_path_factory):
    """The test programs, built once per session."""
    if not os.path.exists(NVCC):
        pytest.skip("nvcc not found: cannot build the CUDA test programs")
    out = tmp_path_factory.mktemp("apps")
    r = subprocess.run(["sh", os.path.join(APPS, "build_apps.sh"), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, f"building tests/apps failed:\n{r.stdout}\n{r.stderr}"
    return out


def phos_run(server, *argv, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "phos.cli", "run", "--server", server.address, "--", *map(str, argv)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def stub_env(server_address, **extra):
    env = dict(os.environ, PHOS_SERVER=server_address, **extra)
    env["LD_LIBRARY_PATH"] = STUB + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


# -- unmodified programs through `phos run` ----------------------------------------------

KERNEL_APPS = ["vector_add", "matmul_tiled", "streams_events", "atomics", "symbols", "threads", "device_reset"]


@pytest.mark.parametrize("app", KERNEL_APPS)
def test_program_runs(apps, server, app):
    r = phos_run(server, apps / app)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), f"{r.stdout}\n{r.stderr}"
    assert "wrong=0" in r.stdout


def test_device_queries(apps, server):
    r = phos_run(server, apps / "device_query")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "runtime=13000" in r.stdout and r.stdout.rstrip().endswith("PASS")


def test_error_paths(apps, server):
    """A bad launch shape fails at launch; an illegal address fails at the next sync and sticks."""
    r = phos_run(server, apps / "errors")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "too many threads: launch: cudaErrorInvalidValue" in r.stdout
    assert "illegal address: synchronize: memory fault" in r.stdout
    assert "illegal address: sticky: memory fault" in r.stdout


def test_driver_api_program(apps, server):
    """Launches with kernelParams and `extra`, module globals, an async copy into pinned memory."""
    r = phos_run(server, apps / "driver_api", apps / "driver_kernels.ptx")
    assert r.returncode == 0 and "PASS" in r.stdout, f"{r.stdout}\n{r.stderr}"
    assert "params: (0,8) (8,4) (16,32) (48,1)" in r.stdout


def test_phos_run_starts_its_own_server(apps):
    r = subprocess.run([sys.executable, "-m", "phos.cli", "run", "--", str(apps / "vector_add")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "PASS" in r.stdout, f"{r.stdout}\n{r.stderr}"


def test_phos_run_returns_the_exit_code(stub, server):
    assert phos_run(server, "/bin/sh", "-c", "exit 7").returncode == 7


def test_program_that_never_uses_the_gpu_never_connects(apps, tmp_path):
    start = time.monotonic()
    r = subprocess.run([str(apps / "no_gpu")], capture_output=True, text=True, timeout=60,
                       env=stub_env(f"ipc://{tmp_path}/nobody.sock"))
    assert r.returncode == 0 and "PASS" in r.stdout and r.stderr == ""
    assert time.monotonic() - start < 2


def test_no_server_is_no_device_within_the_timeout(apps, tmp_path):
    start = time.monotonic()
    r = subprocess.run([str(apps / "device_query")], capture_output=True, text=True, timeout=60,
                       env=stub_env(f"ipc://{tmp_path}/nobody.sock", PHOS_CONNECT_TIMEOUT="2"))
    elapsed = time.monotonic() - start
    assert r.returncode == 1 and "cudaErrorNoDevice" in r.stdout, r.stdout
    assert "no phos server answered" in r.stderr
    assert 1.5 < elapsed < 5


# -- what the libraries export and need ----------------------------------------------------

def _exports(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    return {line.split()[2].split("@")[0] for line in out.splitlines() if len(line.split()) >= 3 and line.split()[1] != "A"}


@pytest.mark.parametrize("lib", [LIBCUDA, LIBCUDART])
def test_exports_only_cuda_entry_points(stub, lib):
    names = _exports(lib)
    assert names, "nothing exported"
    strays = sorted(n for n in names if not re.match(r"^(cu|cuda|__cuda)", n))
    assert not strays, f"non-CUDA symbols exported: {strays[:20]}"
    assert not any(n.startswith(("zmq_", "_ZN5capnp", "_ZN2kj", "_ZNSt")) for n in names)


def test_every_nvidia_runtime_entry_point_exists(stub):
    with open(os.path.join(NATIVE, "tables", "runtime_entry_points.txt")) as f:
        wanted = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    missing = wanted - _exports(LIBCUDART)
    assert not missing, f"a program linked against NVIDIA's libcudart.so.13 would miss {sorted(missing)[:20]}"
    out = subprocess.run(["objdump", "-T", LIBCUDART], capture_output=True, text=True, check=True).stdout
    assert re.search(r"libcudart\.so\.13\s+cudaMalloc$", out, re.M), "runtime symbols must carry NVIDIA's version node"


@pytest.mark.parametrize("lib", [LIBCUDA, LIBCUDART])
def test_needs_only_what_a_bare_machine_has(stub, lib):
    dynamic = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
    assert needed <= {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                      "ld-linux-x86-64.so.2", "libcuda.so.1"}, needed
    assert "TEXTREL" not in dynamic
    symbols = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)", symbols)}
    assert max(versions) <= (2, 34), f"needs glibc {max(versions)}: too new for Ubuntu 22.04 / RHEL 9"
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    assert "not found" not in ldd


# -- loud failure, cuGetProcAddress --------------------------------------------------------

def _python(code, env=None, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_unsupported_calls_fail_loudly_once(stub, tmp_path):
    r = _python(f"""
        import ctypes
        rt = ctypes.CDLL({LIBCUDART!r})
        p = ctypes.c_void_p()
        first = rt.cudaMallocManaged(ctypes.byref(p), 64, 1)
        second = rt.cudaMallocManaged(ctypes.byref(p), 64, 1)
        print(first, second, rt.cudaGetLastError(), rt.cudaGetLastError())
        drv = ctypes.CDLL({LIBCUDA!r})
        print(drv.cuGraphCreate(ctypes.byref(p), 0))
    """, env=stub_env(f"ipc://{tmp_path}/nobody.sock"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["801", "801", "801", "0", "801"]
    assert r.stderr.count("phos: unsupported CUDA call cudaMallocManaged") == 1
    assert r.stderr.count("phos: unsupported CUDA call cuGraphCreate") == 1


def test_cu_get_proc_address_answers_by_name_and_version(stub, tmp_path):
    r = _python(f"""
        import ctypes
        drv = ctypes.CDLL({LIBCUDA!r})
        def lookup(name, version, flags=0):
            fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
            err = drv.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version, ctypes.c_uint64(flags),
                                          ctypes.byref(status))
            return err, fn.value or 0, status.value
        def address(symbol):
            return ctypes.cast(getattr(drv, symbol), ctypes.c_void_p).value
        checks = [
            lookup("cuCtxCreate", 12050)[1] == address("cuCtxCreate_v4"),
            lookup("cuCtxCreate", 3020)[1] == address("cuCtxCreate_v2"),
            lookup("cuMemAlloc", 3020)[1] == address("cuMemAlloc_v2"),
            lookup("cuFuncGetParamInfo", 12040)[1] == address("cuFuncGetParamInfo"),
            lookup("cuEventElapsedTime", 12080)[1] == address("cuEventElapsedTime_v2"),
            lookup("cuMemcpyHtoD", 7000, 2)[1] == address("cuMemcpyHtoD_v2_ptds"),
            lookup("cuFuncGetParamInfo", 12000)[0] == 500,          # version not sufficient
            lookup("cuGraphCreate", 10000)[1] == address("cuGraphCreate"),   # known: a loud stub
            lookup("cuNoSuchCall", 12000) == (500, 0, 1),
        ]
        print(checks)
    """, env=stub_env(f"ipc://{tmp_path}/nobody.sock"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str([True] * 9)
    assert r.stderr == "", "looking names up must print nothing"


# -- the stub's own ZeroMQ stays out of the application's way ------------------------------

def test_stub_and_pyzmq_in_one_process(stub, server):
    """pyzmq's bundled libzmq and the stub's static one live side by side, both usable."""
    pytest.importorskip("zmq")
    r = _python(f"""
        import ctypes, zmq
        version_before = zmq.zmq_version()
        drv = ctypes.CDLL({LIBCUDA!r}, mode=ctypes.RTLD_GLOBAL)
        assert not hasattr(drv, "zmq_version"), "the stub must not export libzmq"
        assert drv.cuInit(0) == 0
        count = ctypes.c_int()
        assert drv.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value >= 1
        ctx = ctypes.c_void_p()
        assert drv.cuCtxCreate_v4(ctypes.byref(ctx), None, 0, 0) == 0
        ptr = ctypes.c_uint64()
        assert drv.cuMemAlloc_v2(ctypes.byref(ptr), 4096) == 0
        src = (ctypes.c_ubyte * 4096)(*[i % 251 for i in range(4096)])
        dst = (ctypes.c_ubyte * 4096)()
        assert drv.cuMemcpyHtoD_v2(ptr, src, 4096) == 0
        assert drv.cuMemcpyDtoH_v2(dst, ptr, 4096) == 0
        assert bytes(dst) == bytes(src)
        c = zmq.Context()
        a, b = c.socket(zmq.PAIR), c.socket(zmq.PAIR)
        a.bind("inproc://check"); b.connect("inproc://check")
        a.send(b"ping"); assert b.recv() == b"ping"
        a.close(); b.close(); c.term()
        assert zmq.zmq_version() == version_before
        assert drv.cuCtxDestroy_v2(ctx) == 0
        print("both usable", version_before)
    """, env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "both usable" in r.stdout


def test_cuda_python_runs_unmodified(stub, server):
    """cuda.bindings.driver resolves everything through cuGetProcAddress_v2 (skipped without cuda-python)."""
    pytest.importorskip("cuda.bindings.driver")
    r = _python("""
        import numpy as np
        from cuda.bindings import driver as cu
        ptx = b'''
        .version 8.0
        .target sm_90
        .address_size 64
        .visible .entry twice(.param .u64 p, .param .u32 n)
        {
          .reg .pred %p; .reg .b32 %r<5>; .reg .b64 %rd<4>; .reg .f32 %f<2>;
          ld.param.u64 %rd1, [p]; ld.param.u32 %r1, [n];
          mov.u32 %r2, %ctaid.x; mov.u32 %r3, %ntid.x; mov.u32 %r4, %tid.x;
          mad.lo.s32 %r2, %r2, %r3, %r4;
          setp.ge.u32 %p, %r2, %r1; @%p bra DONE;
          cvta.to.global.u64 %rd1, %rd1; mul.wide.u32 %rd2, %r2, 4; add.s64 %rd3, %rd1, %rd2;
          ld.global.f32 %f1, [%rd3]; add.f32 %f1, %f1, %f1; st.global.f32 [%rd3], %f1;
        DONE: ret;
        }
        '''
        import ctypes
        assert cu.cuInit(0)[0] == 0
        err, dev = cu.cuDeviceGet(0)
        err, ctx = cu.cuCtxCreate(None, 0, dev); assert err == 0, err
        err, mod = cu.cuModuleLoadData(ptx); assert err == 0, err
        err, fn = cu.cuModuleGetFunction(mod, b"twice"); assert err == 0, err
        x = np.arange(300, dtype=np.float32)
        err, d = cu.cuMemAlloc(x.nbytes); assert err == 0
        assert cu.cuMemcpyHtoD(d, x, x.nbytes)[0] == 0
        args = ((d, 300), (None, ctypes.c_uint32))
        assert cu.cuLaunchKernel(fn, 3, 1, 1, 128, 1, 1, 0, 0, args, 0)[0] == 0
        out = np.zeros_like(x)
        assert cu.cuMemcpyDtoH(out, d, x.nbytes)[0] == 0
        assert np.array_equal(out, 2 * x)
        assert cu.cuCtxDestroy(ctx)[0] == 0
        print("cuda-python ok")
    """, env=stub_env(server.address))
    assert r.returncode == 0 and "cuda-python ok" in r.stdout, r.stdout + r.stderr
