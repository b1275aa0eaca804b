"""Module-image reader: PTX, fatbins (every nvcc 13 compression mode), wrappers, cubins.

Inputs are built with nvcc at test time (no GPU needed to compile)."""
import shutil
import signal
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings, strategies as st

from phos.gpu_server.backends import fatbin
from phos.gpu_server.backends.fatbin import describe, extract_ptx, fatbin_size, image_kind
from phos.schema.cuda_types import CudaError, CUresult

NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc to build test images")

KERNELS = r"""
__device__ int hits;
__constant__ float bias[2] = {0.5f, 0.25f};
__device__ float *last = nullptr;
extern "C" __global__ void add(float *a, const float *b, int n)
{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] += b[i] + bias[i % 2]; if (i == 0) { atomicAdd(&hits, 1); last = a; } }
__global__ void scale(float *a, float s, int n)
{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] *= s; }
"""
VARIABLES = {"hits", "bias", "last"}
APP = KERNELS + r"""
#include <cstdio>
int main() { float *d; cudaMalloc(&d, 64); scale<<<1, 16>>>(d, 2.f, 16);
             cudaDeviceSynchronize(); std::printf("ok\n"); }
"""
SM90 = "-arch=sm_90"
MODES = ["none", "default", "size", "speed", "balance"]
# name -> nvcc arguments; "{out}" is the output file
BUILDS = {
    "ptx": ["-ptx", "-arch=compute_90"],
    "cubin": ["-cubin", SM90],
    "sm90": ["-fatbin", SM90],
    "ptx_only": ["-fatbin", "-gencode", "arch=compute_90,code=compute_90"],
    "sm75_both": ["-fatbin", "-gencode", "arch=compute_75,code=[compute_75,sm_75]"],
    "sass_only": ["-fatbin", "-gencode", "arch=compute_90,code=sm_90",
                  "-gencode", "arch=compute_75,code=sm_75"],
    "ptx100_only": ["-fatbin", "-gencode", "arch=compute_100,code=compute_100"],
    "multi": ["-fatbin", "-gencode", "arch=compute_75,code=[compute_75,sm_75]",
              "-gencode", "arch=compute_100,code=compute_100",
              "-gencode", "arch=compute_86,code=compute_86",
              "-gencode", "arch=compute_90,code=compute_90",
              "-gencode", "arch=compute_80,code=compute_80"],
    "compress_all": ["-fatbin", SM90, "-Xfatbin=-compress-all"],
    **{f"mode_{m}": ["-fatbin", SM90, f"--compress-mode={m}"] for m in MODES},
}


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Build every input once, in parallel (nvcc is the slow part of this file)."""
    d = tmp_path_factory.mktemp("fatbin")
    (d / "k.cu").write_text(KERNELS)
    (d / "app.cu").write_text(APP)

    def nvcc(name, args, src="k.cu"):
        subprocess.run([NVCC, *args, src, "-o", name], cwd=d, check=True, capture_output=True)

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(nvcc, name, args) for name, args in BUILDS.items()]
        jobs.append(pool.submit(nvcc, "app", ["-cudart", "shared", SM90], "app.cu"))
        for job in jobs:
            job.result()
    for section in (".nv_fatbin", ".nvFatBinSegment"):
        subprocess.run(["objcopy", "-O", "binary", f"--only-section={section}", "app", section],
                       cwd=d, check=True)
    out = {name: (d / name).read_bytes() for name in BUILDS}
    out["section"] = (d / ".nv_fatbin").read_bytes()
    out["wrappers"] = (d / ".nvFatBinSegment").read_bytes()
    out["section_addr"] = _section_addr(d / "app", ".nv_fatbin")
    return out


def _section_addr(path, name):
    dump = subprocess.run(["objdump", "-h", "-j", name, str(path)], check=True,
                          capture_output=True, text=True).stdout
    line = next(l for l in dump.splitlines() if f" {name} " in l)
    return int(line.split()[3], 16)  # Idx Name Size VMA ...


def _targets(ptx):
    return [l.split()[1].rstrip(",") for l in ptx.splitlines() if l.startswith(".target")]


def _status(excinfo):
    return excinfo.value.status


# ---------------------------------------------------------------- PTX text

def test_raw_ptx(images):
    ptx = images["ptx"]
    assert image_kind(ptx) == "ptx"
    assert extract_ptx(ptx) == ptx.decode()
    assert extract_ptx(ptx + b"\0\0garbage") == ptx.decode()  # NUL-terminated, as cuModuleLoadData gets it
    assert extract_ptx(b"/* header */\n  // note\n\t.version 8.0\n.target sm_80\n").startswith("/*")
    assert describe(ptx) == [{"kind": "ptx", "arch": 90, "compressed": False,
                              "compression": None, "size": len(ptx)}]


@pytest.mark.parametrize("junk", [b"", b"\0", b"hello", b"// only a comment\n", b"/* open", b".versions 8"])
def test_not_an_image(junk):
    with pytest.raises(CudaError) as e:
        extract_ptx(junk)
    assert _status(e) == CUresult.CUDA_ERROR_INVALID_IMAGE


# ---------------------------------------------------------------- fatbins

def test_layout_of_a_real_entry(images):
    """Pins the header offsets the reader relies on to what nvcc 13 writes."""
    fb = images["mode_none"]
    assert fatbin_size(fb[:16]) == len(fb)
    magic, version, header_size, size = struct.unpack_from("<IHHQ", fb)
    assert (magic, version, header_size, size) == (0xBA55ED50, 1, 16, len(fb) - 16)
    kind, _, ehs, esize = struct.unpack_from("<HHIQ", fb, 16)
    assert (kind, ehs) == (2, 64) and fb[16 + ehs:16 + ehs + 4] == b"\x7fELF"
    ptx_at = 16 + ehs + esize
    fields = fatbin.ENTRY_HEADER.unpack_from(fb, ptx_at)
    assert fields[0] == 1 and fields[7:9] == (9, 90)  # kind, PTX ISA major, arch
    assert fb[ptx_at + fields[2]:].lstrip(b"\n").startswith(b".version 9.0")


def test_plain_fatbin_matches_nvcc_ptx(images):
    ptx = extract_ptx(images["mode_none"])
    assert _targets(ptx) == ["sm_90"]
    assert ".entry add(" in ptx and ".entry _Z5scalePffi(" in ptx
    assert "\0" not in ptx


@pytest.mark.parametrize("build, compression", [
    ("sm90", "zstd"), ("mode_default", "zstd"), ("mode_balance", "zstd"), ("mode_size", "zstd"),
    ("mode_speed", "lz4"), ("compress_all", "zstd"), ("mode_none", None)])
def test_every_compression_mode(images, build, compression):
    ptx_entry = next(e for e in describe(images[build]) if e["kind"] == "ptx")
    assert ptx_entry["compression"] == compression
    assert extract_ptx(images[build]) == extract_ptx(images["mode_none"])


def test_modes_compressing_sass_too(images):
    for build in ("mode_size", "compress_all"):
        elf = next(e for e in describe(images[build]) if e["kind"] == "elf")
        assert elf["compression"] == "zstd" and elf["stored_size"] < elf["size"]


def test_picks_highest_ptx_not_above_the_device(images):
    arches = [(e["kind"], e["arch"]) for e in describe(images["multi"])]
    assert ("ptx", 100) in arches and ("ptx", 80) in arches
    assert _targets(extract_ptx(images["multi"])) == ["sm_90"]
    assert _targets(extract_ptx(images["sm75_both"])) == ["sm_75"]


def test_executable_section_with_several_fatbins(images):
    section = images["section"]
    assert fatbin_size(section) < len(section)  # more than one fatbin back to back
    assert _targets(extract_ptx(section)) == ["sm_90"]
    assert _targets(extract_ptx(section + b"\0" * 24)) == ["sm_90"]  # trailing section padding


def test_wrappers_as_the_native_stub_sends_them(images):
    """Follow each registered wrapper's data pointer into .nv_fatbin, copy fatbin_size bytes."""
    seg, section, base = images["wrappers"], images["section"], images["section_addr"]
    found = []
    for at in range(0, len(seg) - 23, 24):
        magic, _version, data, _ = struct.unpack_from("<IIQQ", seg, at)
        assert magic == fatbin.WRAPPER_MAGIC
        fb = section[data - base:]
        fb = fb[:fatbin_size(fb[:16])]
        for wrapper in (seg[at:at + 16], seg[at:at + 24]):  # the 16-byte form and the full struct
            image = wrapper + fb + b"trailing bytes are not ours"
            assert image_kind(image) == "wrapper"
            try:
                found.append(_targets(extract_ptx(image)))
            except CudaError as e:  # a fatbin of SASS only (nvcc adds one for the runtime)
                assert e.status == CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU
    assert ["sm_90"] in found


def test_wrapper_without_fatbin():
    with pytest.raises(CudaError) as e:
        extract_ptx(struct.pack("<IIQ", fatbin.WRAPPER_MAGIC, 1, 0x401000) + b"\0" * 32)
    assert _status(e) == CUresult.CUDA_ERROR_INVALID_IMAGE and "wrapper" in e.value.message


# ---------------------------------------------------------------- no usable PTX

@pytest.mark.parametrize("build", ["ptx", "cubin", "sm90", "ptx_only", "sass_only", "compress_all", "mode_speed", "section"])
def test_module_variables_are_found_in_every_kind_of_image(images, build):
    """The driver cannot list a module's globals: the cuda backend reads their names here, so a
    checkpoint holds every one, looked up by the program or not."""
    assert set(fatbin.module_variables(images[build])) == VARIABLES


def test_module_variables_of_an_unreadable_image_are_none(images):
    assert fatbin.module_variables(b"junk") == []
    assert fatbin.module_variables(images["sm90"][:200]) == []


@pytest.mark.parametrize("build", ["sass_only", "cubin"])
def test_sass_only_names_kernels_and_the_fix(images, build):
    with pytest.raises(CudaError) as e:
        extract_ptx(images[build])
    assert _status(e) == CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU
    msg = e.value.message
    assert "_Z5scalePffi" in msg and "add" in msg and "compute_90" in msg and "sm_90" in msg


def test_only_newer_ptx(images):
    with pytest.raises(CudaError) as e:
        extract_ptx(images["ptx100_only"])
    assert _status(e) == CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU
    assert "compute_100" in e.value.message


# ---------------------------------------------------------------- damage

def _invalid(image):
    with pytest.raises(CudaError) as e:
        extract_ptx(image)
    assert _status(e) == CUresult.CUDA_ERROR_INVALID_IMAGE, e.value
    return e.value.message


def test_truncated(images):
    fb = images["sm90"]
    assert "truncated" in _invalid(fb[:10])
    assert "claims" in _invalid(fb[:-100])
    with pytest.raises(CudaError):
        fatbin_size(fb[:8])


def test_corrupted(images):
    fb = images["sm90"]
    elf_header_size, elf_size = struct.unpack_from("<IQ", fb, 16 + 4)
    ptx_at = 16 + elf_header_size + elf_size
    big = bytearray(fb)
    struct.pack_into("<Q", big, 24, 9000)  # entry 0's payload size
    assert "fatbin entry 0 claims 9064 bytes but only" in _invalid(big)
    bad = bytearray(fb)
    bad[ptx_at + 80:ptx_at + 84] = b"\xff" * 4  # the zstd frame's magic
    assert "zstd" in _invalid(bad)
    wrong = bytearray(fb)
    struct.pack_into("<Q", wrong, ptx_at + 56, 1234)  # uncompressed size
    assert "1234" in _invalid(wrong)
    assert "fatbin 1" in _invalid(fb + b"junk after the fatbin")
    plain = bytearray(images["mode_none"])
    at = plain.find(b".version")
    plain[at:at + 8] = b"XXXXXXXX"
    assert ".version" in _invalid(plain)


def test_lz4_decoder_edges():
    lz4 = fatbin.lz4_block_decompress
    # literals "ab", then a 10-byte match at offset 2 (overlapping), then literal "c"
    assert lz4(bytes([0x26]) + b"ab" + b"\x02\x00" + bytes([0x10]) + b"c", 13) == b"ab" * 6 + b"c"
    for bad in (b"\xf0", b"\x10a\x05\x00", b"\x10a\x01", b"\x1fa\x01\x00\xff"):
        with pytest.raises(CudaError):
            lz4(bad, 100)
    with pytest.raises(CudaError):
        lz4(b"\x1fa\x01\x00\xff\xff\x00", 20)  # inflates past the declared size


# ---------------------------------------------------------------- random damage

class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang


mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 300), st.integers(0, 255)),  # headers live here
    st.tuples(st.just("byte"), st.integers(0, 1 << 20), st.integers(0, 255)),  # anywhere
    st.tuples(st.just("u64"), st.integers(0, 300), st.integers(0, (1 << 64) - 1)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 20), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(build=st.sampled_from(["sm90", "mode_speed", "compress_all", "multi"]),
       mutations=st.lists(mutation, min_size=1, max_size=4))
def test_random_mutation_only_raises_cuda_error(images, build, mutations):
    image = bytearray(images[build])
    for op, at, value in mutations:
        at %= len(image) + 1
        if op == "byte" and at < len(image):
            image[at] = value
        elif op == "u64":
            image[at:at + 8] = value.to_bytes(8, "little")
        elif op == "cut":
            del image[at:]
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(5)
    try:
        for reader in (extract_ptx, describe, image_kind):
            try:
                reader(bytes(image))
            except CudaError:
                pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
