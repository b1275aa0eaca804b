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
import shlex
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(ROOT, "phos", "stub")
APPS = os.path.join(ROOT, "tests", "apps")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
NVCC = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")
LIBCUDA = os.path.join(STUB, "libcuda.so.1")
LIBCUDART = os.path.join(STUB, "libcudart.so.13")


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


def test_a_program_with_the_runtime_linked_statically_runs(stub, server, tmp_path):
    """nvcc's default: NVIDIA's runtime inside the program, which loads libcuda.so.1, and so phos's."""
    if not os.path.exists(NVCC):
        pytest.skip("nvcc not found")
    binary = tmp_path / "vector_add_static"
    r = subprocess.run([NVCC, "-gencode", "arch=compute_90,code=compute_90", "-o", str(binary),
                        os.path.join(ROOT, "examples", "vector_add.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "libcudart" not in subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    r = phos_run(server, binary)
    assert r.returncode == 0 and "correct" in r.stdout, f"{r.stdout}\n{r.stderr}"


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


def test_the_driver_stays_loaded_when_a_runtime_dlcloses_it():
    """NVIDIA's runtime dlcloses libcuda.so.1 when cuInit fails (no server): the library must
    stay mapped, as ZeroMQ's I/O threads still run in it (unmapped, the program died at exit)."""
    code = ("import ctypes, _ctypes, os\n"
            f"path = {os.path.join(STUB, 'libcuda.so.1')!r}\n"
            "lib = ctypes.CDLL(path)\n"
            "_ctypes.dlclose(lib._handle)\n"
            "ctypes.CDLL(path, mode=os.RTLD_NOLOAD)\n")     # OSError once it is unloaded
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_no_server_is_no_device_within_the_timeout(apps, tmp_path):
    start = time.monotonic()
    r = subprocess.run([str(apps / "device_query")], capture_output=True, text=True, timeout=60,
                       env=stub_env(f"ipc://{tmp_path}/nobody.sock", PHOS_CONNECT_TIMEOUT="2"))
    elapsed = time.monotonic() - start
    assert r.returncode == 1 and "cudaErrorNoDevice" in r.stdout, r.stdout
    assert "no phos server answered" in r.stderr
    assert 1.5 < elapsed < 5


# -- the shared staging area: bulk copies and the mailbox ------------------------------------
#
# A worker that shares the client's host maps a file the stub offers at attach: copies of
# 256 KiB and more go through its two slots, and synchronous calls through its mailbox. It maps
# pinned memory too (tests/native/test_pinned_host.py): copies from and to it go in place.

BIG_COPIES_CU = r"""
// Large copies (through phos's shared staging area when the server shares the host):
// both directions, pageable and pinned, synchronous and asynchronous, at odd sizes and
// offsets; then a bad large copy, which must fail entirely and leave the context usable.
#include <dirent.h>
#include <unistd.h>
#include <cstring>
#include <string>
#include "common.h"

__global__ void sample(const unsigned char* p, size_t n, size_t stride, unsigned* out, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        size_t at = (size_t)i * stride;
        out[i] = at < n ? p[at] : 0xffffffffu;
    }
}

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i >> 12) * 7 + i * 13 + seed); }

static void fill(unsigned char* p, size_t n, unsigned seed, size_t base = 0) {
    for (size_t i = 0; i < n; i++) p[i] = pattern(base + i, seed);
}

static size_t wrong(const unsigned char* p, size_t n, unsigned seed, size_t base = 0) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != pattern(base + i, seed);
    return bad;
}

static size_t not_byte(const unsigned char* p, size_t n, unsigned char v) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += p[i] != v;
    return bad;
}

static int staging_files_left() {   // phos closes its staging memfd once the worker answered
    int n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
        while (dirent* e = readdir(d)) {
            char target[256] = {0};
            std::string link = std::string("/proc/self/fd/") + e->d_name;
            if (readlink(link.c_str(), target, sizeof target - 1) > 0) n += strncmp(target, "/memfd:phos", 11) == 0;
        }
        closedir(d);
    }
    return n;
}

int main() {
    const size_t N = (80u << 20) + 12345;        // three staging chunks, the last one odd
    const size_t off = (33u << 20) + 7, len = (40u << 20) + 3;
    CHECK(cudaFree(0));
    printf("staging files left: %d\n", staging_files_left());
    unsigned char* d;
    CHECK(cudaMalloc(&d, N));
    const int count = 4096;
    const size_t stride = N / count + 1;
    unsigned* d_samples;
    CHECK(cudaMalloc(&d_samples, count * sizeof(unsigned)));
    unsigned* samples = (unsigned*)malloc(count * sizeof(unsigned));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));

    for (int pinned = 0; pinned < 2; pinned++) {
        const char* kind = pinned ? "pinned" : "pageable";
        unsigned char *a, *a2, *b;
        if (pinned) {
            CHECK(cudaMallocHost(&a, N));
            CHECK(cudaMallocHost(&a2, len));
            CHECK(cudaMallocHost(&b, N));
        } else {
            a = (unsigned char*)malloc(N);
            a2 = (unsigned char*)malloc(len);
            b = (unsigned char*)malloc(N);
        }
        fill(a, N, pinned);
        fill(a2, len, 100 + pinned);

        // host->device, checked on the device by a kernel, then device->host
        CHECK(cudaMemcpy(d, a, N, cudaMemcpyHostToDevice));
        sample<<<count / 256, 256>>>(d, N, stride, d_samples, count);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(samples, d_samples, count * sizeof(unsigned), cudaMemcpyDeviceToHost));
        size_t bad_samples = 0;
        for (int i = 0; i < count; i++) bad_samples += (size_t)i * stride < N && samples[i] != a[(size_t)i * stride];
        memset(b, 0, N);
        CHECK(cudaMemcpy(b, d, N, cudaMemcpyDeviceToHost));
        size_t bad_whole = wrong(b, N, pinned);

        // a range at odd offsets, device->host
        memset(b, 0, N);
        CHECK(cudaMemcpy(b, d + off, len, cudaMemcpyDeviceToHost));
        size_t bad_range = wrong(b, len, pinned, off) + not_byte(b + len, N - len, 0);

        // asynchronous both ways on a stream: overwrite a range, read all back
        memset(b, 0, N);
        CHECK(cudaMemcpyAsync(d + off, a2, len, cudaMemcpyHostToDevice, s));
        CHECK(cudaMemcpyAsync(b, d, N, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        size_t bad_async = wrong(b, off, pinned) + wrong(b + off, len, 100 + pinned) +
                           wrong(b + off + len, N - off - len, pinned, off + len);

        // device->device (ranges apart) stays on the device, ordered after the copy before it
        const size_t moved = (30u << 20) + 5, to = N - moved;
        CHECK(cudaMemcpy(d, a, N, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(d + to, d, moved, cudaMemcpyDeviceToDevice));
        memset(b, 0, N);
        CHECK(cudaMemcpy(b, d, N, cudaMemcpyDeviceToHost));
        size_t bad_dtod = wrong(b, to, pinned) + wrong(b + to, moved, pinned, 0);

        printf("%s: samples wrong=%zu, whole wrong=%zu, range wrong=%zu, async wrong=%zu, dtod wrong=%zu\n", kind,
               bad_samples, bad_whole, bad_range, bad_async, bad_dtod);
        if (pinned) {
            CHECK(cudaFreeHost(a));
            CHECK(cudaFreeHost(a2));
            CHECK(cudaFreeHost(b));
        } else {
            free(a);
            free(a2);
            free(b);
        }
    }

    // A copy larger than its allocation fails as a whole: nothing is written either side.
    const size_t small_bytes = 64u << 20;
    unsigned char* small;
    CHECK(cudaMalloc(&small, small_bytes));
    CHECK(cudaMemset(small, 0x5a, small_bytes));
    unsigned char* a = (unsigned char*)malloc(N);
    unsigned char* b = (unsigned char*)malloc(N);
    fill(a, N, 7);
    memset(b, 0xee, N);
    cudaError_t up = cudaMemcpy(small, a, N, cudaMemcpyHostToDevice);
    cudaError_t up_last = cudaGetLastError();
    cudaError_t down = cudaMemcpy(b, small, N, cudaMemcpyDeviceToHost);
    cudaError_t down_last = cudaGetLastError();
    printf("too large: h2d %s (last %s), d2h %s (last %s), host untouched wrong=%zu\n", cudaGetErrorName(up),
           cudaGetErrorName(up_last), cudaGetErrorName(down), cudaGetErrorName(down_last), not_byte(b, N, 0xee));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(b, small, small_bytes, cudaMemcpyDeviceToHost));
    printf("after: device untouched wrong=%zu\n", not_byte(b, small_bytes, 0x5a));
    CHECK(cudaMemcpy(small, a, small_bytes, cudaMemcpyHostToDevice));
    memset(b, 0, N);
    CHECK(cudaMemcpy(b, small, small_bytes, cudaMemcpyDeviceToHost));
    printf("after: context usable wrong=%zu\n", wrong(b, small_bytes, 7));
    CHECK(cudaFree(small));
    CHECK(cudaFree(d));
    CHECK(cudaFree(d_samples));
    CHECK(cudaStreamDestroy(s));
    free(a);
    free(b);
    free(samples);
    printf("staging files left: %d\n", staging_files_left());
    printf("PASS\n");
    return 0;
}
"""

BIG_COPIES_OUT = [
    "staging files left: 0",
    "pageable: samples wrong=0, whole wrong=0, range wrong=0, async wrong=0, dtod wrong=0",
    "pinned: samples wrong=0, whole wrong=0, range wrong=0, async wrong=0, dtod wrong=0",
    "too large: h2d cudaErrorInvalidValue (last cudaErrorInvalidValue), "
    "d2h cudaErrorInvalidValue (last cudaErrorInvalidValue), host untouched wrong=0",
    "after: device untouched wrong=0",
    "after: context usable wrong=0",
    "staging files left: 0",
    "PASS",
]


@pytest.fixture(scope="session")
def big_copies(apps):
    """A program of large copies (80 MiB + odd bytes), built like tests/apps."""
    src = apps / "big_copies.cu"
    src.write_text(BIG_COPIES_CU)
    exe = apps / "big_copies"
    r = subprocess.run([NVCC, "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90",
                        "-gencode", "arch=compute_90,code=sm_90", "-I", APPS, "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"building big_copies failed:\n{r.stdout}\n{r.stderr}"
    return exe


def run_stub(server, exe, *args, timeout=300, **env):
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=stub_env(server.address, PHOS_VERBOSE="1", **env))


def stub_stats(stderr):
    """The stub's per-context counts (PHOS_VERBOSE), summed over contexts."""
    found = re.findall(r"(\d+) requests through the mailbox, (\d+) over the socket, (\d+) doorbells, "
                       r"(\d+) bytes staged, (\d+) bytes copied in place", stderr)
    assert found, f"no statistics in the stub's verbose output:\n{stderr}"
    totals = [sum(int(f[i]) for f in found) for i in range(5)]
    return dict(zip(["mailbox", "socket", "doorbells", "staged", "in_place"], totals))


# The mailbox is used by default while both sides spin (many-core hosts); PHOS_MAILBOX=1
# forces it, with the doorbell, wherever these tests run.
MAILBOX_SETTINGS = [{"PHOS_MAILBOX": "1", "PHOS_SPIN_US": "0"}, {"PHOS_MAILBOX": "1", "PHOS_SPIN_US": "50"}]
MAILBOX_IDS = ["mailbox-no-spin", "mailbox-spinning"]


@pytest.mark.parametrize("settings", [{}] + MAILBOX_SETTINGS, ids=["default"] + MAILBOX_IDS)
def test_large_copies_go_through_the_staging_area(big_copies, server, settings):
    """80 MiB + odd bytes both ways, pageable and pinned, sync and async, at odd offsets; a
    copy larger than its allocation fails whole, touches nothing, and the context lives on."""
    r = run_stub(server, big_copies, **settings)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == BIG_COPIES_OUT, r.stdout + r.stderr
    assert "the worker mapped the staging area" in r.stderr
    assert "ctxDestroy:" not in r.stderr and "malformed" not in r.stderr, r.stderr   # no failure of the exit's doorbell either
    stats = stub_stats(r.stderr)
    # the bulk bytes went through it, those of pinned memory (which the worker maps) in place
    assert stats["staged"] >= 5 * (80 << 20) and stats["in_place"] >= 5 * (80 << 20), stats
    if settings:   # the mailbox forced: synchronous calls skip the socket
        assert stats["mailbox"] > 0, stats
        if (os.cpu_count() or 1) <= 4:
            assert stats["doorbells"] > 0, stats   # workers do not spin here: the socket wakes them


def test_large_copies_without_the_staging_area(big_copies, server):
    """PHOS_STAGING=0: nothing offered, every byte in frames, the same results."""
    r = run_stub(server, big_copies, PHOS_STAGING="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == BIG_COPIES_OUT, r.stdout + r.stderr
    assert "staging area" not in r.stderr
    stats = stub_stats(r.stderr)
    assert stats["mailbox"] == stats["doorbells"] == stats["staged"] == stats["in_place"] == 0, stats


PAGEABLE_COPIES_OUT = ["sync: device samples wrong=0, back wrong=0", "async: back wrong=0"]


@pytest.mark.parametrize("threads, started", [("4", 3), ("1", 0), ("0", 0)])
def test_large_pageable_copies_on_several_threads(apps, server, threads, started):
    """tests/apps/pageable_copies.cu: 100 MiB + odd bytes between pageable memory at odd offsets and
    the device, both ways, sync and async, every byte checked. The stub copies each staged chunk
    into and out of its slot on PHOS_COPY_THREADS threads (client_stub/native/parallel_copy.cpp),
    the caller one of them: the helpers start at the first large copy; 0 or 1, none."""
    r = run_stub(server, apps / "pageable_copies", PHOS_COPY_THREADS=threads)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == PAGEABLE_COPIES_OUT + [f"threads started by the copies: {started}", "PASS"], \
        r.stdout + r.stderr
    assert f"host copies on {max(1, int(threads))} thread" in r.stderr, r.stderr
    assert stub_stats(r.stderr)["staged"] >= 4 * (100 << 20)


@pytest.mark.parametrize("app", ["streams_events", "errors", "threads"])
def test_programs_through_the_mailbox(apps, server, app):
    """Synchronous calls through the mailbox: same output as over the socket, errors included."""
    plain = run_stub(server, apps / app, PHOS_STAGING="0")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    for settings in MAILBOX_SETTINGS:
        boxed = run_stub(server, apps / app, **settings)
        assert boxed.returncode == 0, boxed.stdout + boxed.stderr
        assert boxed.stdout == plain.stdout, settings
        assert "malformed" not in boxed.stderr, boxed.stderr   # (errors' ctxDestroy at exit fails: the fault sticks)
        assert stub_stats(boxed.stderr)["mailbox"] > 0, settings


def test_mailbox_with_a_spinning_worker(apps, big_copies, backend, tmp_path):
    """Workers that spin (as on a many-core host) watch the box and answer there: a client
    that spins (PHOS_SPIN_US=50) uses the mailbox by default and sees Replies at once; one
    that does not spin (the mailbox forced) finds them in short sleeps."""
    from conftest import ServerProc
    saved = os.environ.get("PHOS_SPIN_US")
    # the server's workers inherit it: 20 ms, so that a client descheduled between two calls
    # on a loaded machine still finds its worker watching the box
    os.environ["PHOS_SPIN_US"] = "20000"
    try:
        srv = ServerProc(backend, tmp_path)
    finally:
        if saved is None:
            del os.environ["PHOS_SPIN_US"]
        else:
            os.environ["PHOS_SPIN_US"] = saved
    try:
        for settings in ({"PHOS_SPIN_US": "50"}, {"PHOS_SPIN_US": "0", "PHOS_MAILBOX": "1"}):
            r = run_stub(srv, apps / "streams_events", **settings)
            assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), r.stdout + r.stderr
            assert stub_stats(r.stderr)["mailbox"] > 0, r.stderr
            r = run_stub(srv, big_copies, **settings)
            assert r.returncode == 0 and r.stdout.splitlines() == BIG_COPIES_OUT, r.stdout + r.stderr
            assert stub_stats(r.stderr)["mailbox"] > 0, r.stderr
    finally:
        srv.stop()


def test_staging_file_is_a_sealed_memfd_closed_after_attach(stub, server):
    """The file is named only between the offer and the worker's answer (its descriptor), then
    only mapped, so nothing can be left behind; sealed, so it cannot be cut short under the worker."""
    r = _python(f"""
        import ctypes, fcntl, os
        drv = ctypes.CDLL({LIBCUDA!r})
        assert drv.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        assert drv.cuCtxCreate_v4(ctypes.byref(ctx), None, 0, 0) == 0
        def target(fd):
            try:
                return os.readlink(f"/proc/self/fd/{{fd}}")
            except FileNotFoundError:      # listdir's own descriptor
                return ""
        left = [n for n in os.listdir("/proc/self/fd") if target(n).startswith("/memfd:phos")]
        [(where, mapped)] = {{(line.split()[0], line.split(None, 5)[-1].strip()) for line in open("/proc/self/maps")
                             if "/memfd:phos" in line}}
        with open(f"/proc/self/map_files/{{where}}") as f:
            seals = fcntl.fcntl(f.fileno(), fcntl.F_GET_SEALS)
        assert drv.cuCtxDestroy_v2(ctx) == 0
        print("left", len(left), "sealed", seals & fcntl.F_SEAL_SHRINK == fcntl.F_SEAL_SHRINK, "mapped", mapped)
    """, env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "left 0 sealed True mapped /memfd:phos (deleted)", r.stdout


# -- what the libraries export and need ----------------------------------------------------

def _exports(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    return {line.split()[2].split("@")[0] for line in out.splitlines() if len(line.split()) >= 3 and line.split()[1] != "A"}


@pytest.mark.parametrize("lib", [LIBCUDA])
def test_exports_only_cuda_entry_points(stub, lib):
    names = _exports(lib)
    assert names, "nothing exported"
    strays = sorted(n for n in names if not re.match(r"^(cu|cuda|__cuda)", n))
    assert not strays, f"non-CUDA symbols exported: {strays[:20]}"
    assert not any(n.startswith(("zmq_", "_ZN5capnp", "_ZN2kj", "_ZNSt")) for n in names)


def test_the_runtime_beside_the_driver_is_nvidias(stub):
    """phos/stub/libcudart.so.13 is NVIDIA's own runtime, copied from the nvidia-cuda-runtime
    wheel: one runtime, the one PyTorch and the CUDA libraries load, on phos's driver."""
    from test_nvidia_runtime import nvidia_runtime_dir
    wheel = os.path.join(nvidia_runtime_dir() or "", "libcudart.so.13")
    assert os.path.exists(wheel), "NVIDIA's libcudart.so.13 not installed (pip install nvidia-cuda-runtime)"
    with open(LIBCUDART, "rb") as ours, open(wheel, "rb") as theirs:
        assert ours.read() == theirs.read()
    assert os.readlink(os.path.join(STUB, "libcudart.so")) == "libcudart.so.13"


def test_needs_only_what_a_bare_machine_has(stub):
    dynamic = subprocess.run(["readelf", "-d", LIBCUDA], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
    assert needed <= {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                      "ld-linux-x86-64.so.2"}, needed
    assert "TEXTREL" not in dynamic
    symbols = subprocess.run(["objdump", "-T", LIBCUDA], capture_output=True, text=True, check=True).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)", symbols)}
    assert max(versions) <= (2, 34), f"needs glibc {max(versions)}: too new for Ubuntu 22.04 / RHEL 9"
    ldd = subprocess.run(["ldd", LIBCUDA], capture_output=True, text=True).stdout
    assert "not found" not in ldd


# -- loud failure, cuGetProcAddress --------------------------------------------------------

def _python(code, env=None, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_unsupported_calls_fail_loudly_once(stub, tmp_path):
    r = _python(f"""
        import ctypes
        drv = ctypes.CDLL({LIBCUDA!r})
        p = ctypes.c_void_p()
        print(drv.cuGraphicsMapResources(1, ctypes.byref(p), None), drv.cuGraphicsMapResources(1, ctypes.byref(p), None))
    """, env=stub_env(f"ipc://{tmp_path}/nobody.sock"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["801", "801"]
    assert r.stderr.count("phos: unsupported CUDA call cuGraphicsMapResources") == 1


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
            lookup("cuFuncGetParamInfo", 12000)[::2] == (0, 2),     # version not sufficient: said by the status
            lookup("cuGraphicsMapResources", 3000)[1] == address("cuGraphicsMapResources"),   # known: a loud stub
            lookup("cuNoSuchCall", 12000) == (0, 0, 1),             # as NVIDIA's driver answers (H200)
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


def test_setting_a_function_attribute_to_its_value_again_costs_no_round_trip(stub, server):
    """Flash attention sets its kernels' dynamic shared memory before every launch: the same
    value again is answered here (the server holds it), a new one still goes there."""
    pytest.importorskip("cuda.bindings.driver")
    r = _python("""
        from cuda.bindings import driver as cu
        ptx = b".version 8.0\\n.target sm_90\\n.address_size 64\\n.visible .entry nothing() { ret; }\\n"
        MAX_SHARED = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        assert cu.cuInit(0)[0] == 0
        err, ctx = cu.cuCtxCreate(None, 0, cu.cuDeviceGet(0)[1]); assert err == 0, err
        err, fn = cu.cuModuleGetFunction(cu.cuModuleLoadData(ptx)[1], b"nothing"); assert err == 0, err
        for value in [64 << 10] * 200 + [32 << 10]:
            assert cu.cuFuncSetAttribute(fn, MAX_SHARED, value)[0] == 0
        assert cu.cuFuncGetAttribute(MAX_SHARED, fn) == (cu.CUresult.CUDA_SUCCESS, 32 << 10)
        # the server checks the launch's shared memory against the last value it was given
        assert cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 40 << 10, 0, 0, 0)[0] == 0
        err, = cu.cuCtxSynchronize()
        assert err != cu.CUresult.CUDA_SUCCESS, err
        cu.cuCtxDestroy(ctx)
        print("attributes ok")
    """, env=stub_env(server.address, PHOS_VERBOSE="1"))
    assert r.returncode == 0 and "attributes ok" in r.stdout, r.stdout + r.stderr
    stats = stub_stats(r.stderr)
    assert stats["mailbox"] + stats["socket"] < 50, stats      # not 200 round trips


@pytest.mark.parametrize("hidden", [["system"], ["system", "own"]])
def test_curve_keys_need_no_installed_libsodium(stub, backend, tmp_path, hidden):
    """phos/stub carries its own libsodium.so.23 for CURVE, as GPU machines and GPU-less
    clients often have none installed. With the system's hidden (in a mount namespace of the
    program's own, /dev/null bound over it) a program still reaches a CURVE-keyed server; with
    the stub's copy hidden too, cuInit fails and says what is missing."""
    from conftest import ServerProc
    from share_nothing import keygen, unshare_permitted
    from phos.stub_run import free_port_pair
    why = unshare_permitted()
    if why:
        pytest.skip(f"cannot make a mount namespace: {why}")
    keys = keygen(tmp_path / "keys")
    srv = ServerProc(backend, tmp_path, listen=f"tcp://127.0.0.1:{free_port_pair()}", extra=["--auth-dir", str(keys)])
    try:
        system = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
        paths = {"system": [line.split("=> ")[-1] for line in system.splitlines() if "libsodium.so.23 " in line],
                 "own": [os.path.join(STUB, "libsodium.so.23")]}
        hide = [f"mount --bind /dev/null {shlex.quote(p)}" for name in hidden for p in paths[name] if os.path.exists(p)]
        program = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).cuInit(0))"
        script = "\n".join(["set -e", *hide, 'exec "$@"'])
        # loaded by its path, as a program whose RPATH names the stub: no LD_LIBRARY_PATH leads to the copy
        env = dict(os.environ, PHOS_SERVER=srv.address, PHOS_SERVER_KEY=str(keys / "server.key"),
                   PHOS_CLIENT_KEY=str(keys / "client.key_secret"), PHOS_CONNECT_TIMEOUT="5")
        env.pop("LD_LIBRARY_PATH", None)
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                            sys.executable, "-c", program, LIBCUDA], capture_output=True, text=True, timeout=60, env=env)
        if hidden == ["system"]:
            assert r.returncode == 0 and r.stdout.split() == ["0"], r.stdout + r.stderr
        else:
            assert r.stdout.split() == ["100"], r.stdout + r.stderr      # CUDA_ERROR_NO_DEVICE
            assert "CURVE needs libsodium" in r.stderr, r.stderr
    finally:
        srv.stop()


def test_verbose_statistics_name_the_calls_the_program_waited_for(stub, server):
    """PHOS_VERBOSE's per-context line names the synchronous calls that cost the program most,
    with their count and the time it waited: where a slow program waits on the server."""
    r = _python(f"""
        import ctypes
        drv = ctypes.CDLL({LIBCUDA!r})
        ctx, module = ctypes.c_void_p(), ctypes.c_void_p()
        ptx = b".version 8.0\\n.target sm_90\\n.address_size 64\\n.visible .entry nothing() {{ ret; }}\\n"
        assert drv.cuInit(0) == 0
        assert drv.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
        assert drv.cuModuleLoadData(ctypes.byref(module), ptx) == 0
        for _ in range(3):
            assert drv.cuCtxSynchronize() == 0
        assert drv.cuCtxDestroy_v2(ctx) == 0
        print("ok")
    """, env=stub_env(server.address, PHOS_VERBOSE="1"))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    line = next((x for x in r.stderr.splitlines() if "requests through the mailbox" in x), "")
    waits = dict((m[0], (int(m[1]), float(m[2]))) for m in re.findall(r"[,;](?: waited for)? (\w+) (\d+) in ([\d.]+) ms", line))
    assert waits.get("ctxSynchronize", (0,))[0] == 3, line
    assert waits.get("moduleLoad", (0,))[0] == 1, line
    assert all(ms >= 0 for _, ms in waits.values()), line
