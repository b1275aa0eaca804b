"""The worker's side of the driver calls NVIDIA's runtime and libraries make beyond plain
launches: each kernel's own figures, cuFuncSetAttribute (kept with the function, and in
images, so a restored context keeps it), occupancy answered by the device, tensor maps
(which the emulated device has none of, and says so) and the context's limits (kept in
images too)."""
import os
import struct
from types import SimpleNamespace as Args

import numpy as np
import pytest

from phos.gpu_server.worker import calls
from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import LAUNCH_CONFIG, TENSOR_MAP_TILED
from phos.snapshot.engine import Checkpoint, Restore
from phos.snapshot.image import read_image
from phos.snapshot.store import DirStore
from ptx_helpers import compile_ptx

MAX_THREADS, SHARED_SIZE, NUM_REGS, MAX_DYNAMIC_SHARED = 0, 1, 4, 8     # CUfunction_attribute
PER_BLOCK = 20 << 10          # floats a block reverses: 80 KiB of dynamic shared memory


def kernel_session():
    s = Session(EmuBackend(), 7, b"t" * 16)
    module = calls.module_load(s, Args(payload=1, digest=b""), [compile_ptx("dynshared.cu").encode()])["u64s"][0]
    reply = calls.module_get_function(s, Args(module=module, name="reverse_blocks"), [])
    return s, reply["u64s"][0], reply["u64s"][1:]


def device_floats(s, x, n):
    out = np.empty(n * 4, np.uint8)
    s.backend.dtoh(x, out, None)
    return out.view(np.float32)


def reverse(s, fn, x):
    config = LAUNCH_CONFIG.pack(2, 1, 1, 128, 1, 1, PER_BLOCK * 4, 0, 0)
    calls.run_launch(s, fn, config, struct.pack("<Qi", x, PER_BLOCK))


def test_a_function_comes_with_the_devices_figures_for_it():
    _, _, figures = kernel_session()
    assert len(figures) == 16
    assert figures[MAX_THREADS] == 1024 and figures[NUM_REGS] == 32 and figures[SHARED_SIZE] == 0
    assert figures[MAX_DYNAMIC_SHARED] == 48 << 10


def test_the_dynamic_shared_memory_opt_in_reaches_the_device_and_survives_a_restore(tmp_path):
    s, fn, _ = kernel_session()
    data = np.arange(2 * PER_BLOCK, dtype=np.float32)
    x = s.backend.alloc(data.nbytes)
    s.backend.htod(x, data.tobytes(), None)
    with pytest.raises(CudaError) as e:             # 80 KiB without the opt-in
        reverse(s, fn, x)
    assert "shared" in e.value.message
    calls.func_set_attribute(s, Args(function=fn, attribute=MAX_DYNAMIC_SHARED, value=PER_BLOCK * 4), [])
    reverse(s, fn, x)
    out = device_floats(s, x, data.size)
    assert (out[:PER_BLOCK] == data[:PER_BLOCK][::-1]).all() and (out[PER_BLOCK:] == data[PER_BLOCK:][::-1]).all()

    cp = Checkpoint(s, DirStore(tmp_path), "a", paused=True, chunk_size=1 << 20)
    cp.cut(1, paused=True)
    cp.finish(1)
    [f] = read_image(DirStore(tmp_path), "a").functions
    assert f["attributes"] == [[MAX_DYNAMIC_SHARED, PER_BLOCK * 4]]
    fresh = Session(EmuBackend(), 0, b"t" * 16)
    r = Restore(fresh, DirStore(tmp_path), "a")
    r.recreate()
    r.start(full=True)
    r.wait()
    reverse(fresh, fn, x)                           # the restored kernel kept its opt-in
    assert (device_floats(fresh, x, data.size) == data).all()


def test_occupancy_is_the_devices_answer():
    s, fn, _ = kernel_session()
    [blocks] = calls.func_occupancy(s, Args(function=fn, query="maxActiveBlocks", a=256, b=0, flags=0, grid=0), [])["u64s"]
    assert blocks == 2048 // 256
    [fewer] = calls.func_occupancy(s, Args(function=fn, query="maxActiveBlocks", a=256, b=100 << 10, flags=0, grid=0), [])["u64s"]
    assert fewer == (228 << 10) // (100 << 10)
    min_grid, block = calls.func_occupancy(s, Args(function=fn, query="maxPotentialBlockSize", a=0, b=0, flags=0, grid=0), [])["u64s"]
    assert block > 0 and min_grid > 0


def test_an_unknown_occupancy_query_and_clusters_are_refused_clearly():
    s, fn, _ = kernel_session()
    with pytest.raises(CudaError) as e:
        calls.func_occupancy(s, Args(function=fn, query="maxActiveClusters", a=128, b=0, flags=2, grid=2), [])
    assert e.value.status == CUresult.CUDA_ERROR_NOT_SUPPORTED and "cluster" in e.value.message


def test_tensor_maps_are_refused_by_name_on_emu_and_bad_ones_everywhere():
    s, _, _ = kernel_session()
    good = TENSOR_MAP_TILED.pack(7, 2, 0x600000000000, 64, 64, 0, 0, 0, 256, 0, 0, 0, 8, 8, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(CudaError) as e:
        calls.tensor_map_encode(s, Args(im2col=False, args=good), [])
    assert e.value.status == CUresult.CUDA_ERROR_NOT_SUPPORTED and "cuTensorMapEncode" in e.value.message
    for bad in (good[:-4], TENSOR_MAP_TILED.pack(7, 9, *TENSOR_MAP_TILED.unpack(good)[2:])):
        with pytest.raises(CudaError) as e:
            calls.tensor_map_encode(s, Args(im2col=False, args=bad), [])
        assert e.value.status == CUresult.CUDA_ERROR_INVALID_VALUE


def test_only_settable_attributes_are_set():
    s, fn, _ = kernel_session()
    for attribute, value in ((NUM_REGS, 8), (MAX_DYNAMIC_SHARED, -5), (99, 1)):
        with pytest.raises(CudaError) as e:
            calls.func_set_attribute(s, Args(function=fn, attribute=attribute, value=value), [])
        assert e.value.status == CUresult.CUDA_ERROR_INVALID_VALUE
    assert not s.lookup("function", fn).set_attributes


STACK_SIZE, MALLOC_HEAP_SIZE, DEV_RUNTIME_SYNC_DEPTH, SHMEM_SIZE, CIG_ENABLED = 0, 2, 3, 7, 8    # CUlimit


def limit(s, which, value=None):
    return calls.ctx_limit(s, Args(limit=which, value=value or 0, set=value is not None), [])["u64s"][0]


def test_limits_are_the_devices_and_a_set_one_survives_a_restore(tmp_path):
    s = Session(EmuBackend(), 7, b"t" * 16)
    assert limit(s, STACK_SIZE) == 1024 and limit(s, CIG_ENABLED) == 0     # cuBLAS asks for the second
    assert limit(s, MALLOC_HEAP_SIZE, 64 << 20) == 64 << 20
    assert limit(s, MALLOC_HEAP_SIZE) == 64 << 20
    cp = Checkpoint(s, DirStore(tmp_path), "a", paused=True, chunk_size=1 << 20)
    cp.cut(1, paused=True)
    cp.finish(1)
    assert read_image(DirStore(tmp_path), "a").session["limits"] == [[MALLOC_HEAP_SIZE, 64 << 20]]
    fresh = Session(EmuBackend(), 0, b"t" * 16)
    Restore(fresh, DirStore(tmp_path), "a").recreate()
    assert limit(fresh, MALLOC_HEAP_SIZE) == 64 << 20 and limit(fresh, STACK_SIZE) == 1024


@pytest.mark.parametrize("which, value, status", [
    (DEV_RUNTIME_SYNC_DEPTH, None, CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT),    # a 9.0 device has none
    (99, None, CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT),
    (99, 1, CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT),
    (CIG_ENABLED, 1, CUresult.CUDA_ERROR_INVALID_VALUE),
    (SHMEM_SIZE, 1, CUresult.CUDA_ERROR_INVALID_VALUE),
])
def test_a_limit_the_device_lacks_or_cannot_change_is_refused(which, value, status):
    s = Session(EmuBackend(), 7, b"t" * 16)
    with pytest.raises(CudaError) as e:
        limit(s, which, value)
    assert e.value.status == status
    assert s.limits == {}


# -- reserved ranges and the mappings in them (cuMemAddressReserve, cuMemMap) ---------------

def test_a_mapping_in_a_reserved_range_survives_a_restore_with_its_range(tmp_path):
    s = Session(EmuBackend(), 7, b"t" * 16)
    base = calls.mem_reserve(s, Args(size=32 << 20, alignment=0, at=0), [])["u64s"][0]
    at = base + (4 << 20)
    assert calls.mem_alloc(s, Args(size=2 << 20, at=at), [])["u64s"][0] == at
    s.backend.htod(at, b"phos" * 1024, None)
    cp = Checkpoint(s, DirStore(tmp_path), "a", paused=True, chunk_size=1 << 20)
    cp.cut(1, paused=True)
    cp.finish(1)
    assert read_image(DirStore(tmp_path), "a").session["reserved"] == [[base, 32 << 20]]
    fresh = Session(EmuBackend(), 0, b"t" * 16)
    r = Restore(fresh, DirStore(tmp_path), "a")
    r.recreate()
    r.start(full=True)
    r.wait()
    out = np.empty(4096, np.uint8)
    fresh.backend.dtoh(at, out, None)
    assert out.tobytes() == b"phos" * 1024
    assert calls.mem_alloc(fresh, Args(size=2 << 20, at=base), [])["u64s"][0] == base    # the range grows on
    with pytest.raises(CudaError, match="still has 2 mapping"):
        calls.mem_unreserve(fresh, Args(ptr=base), [])
    calls.mem_free(fresh, Args(ptr=base), [])
    calls.mem_free(fresh, Args(ptr=at), [])
    calls.mem_unreserve(fresh, Args(ptr=base), [])
    assert fresh.space.reserved == {}


def test_a_mapping_outside_a_reserved_range_is_refused():
    s = Session(EmuBackend(), 7, b"t" * 16)
    free_address = s.space.free[0][0]
    with pytest.raises(CudaError, match="not inside a reserved range"):
        calls.mem_alloc(s, Args(size=2 << 20, at=free_address), [])
    assert s.space.allocations() == []


# -- module images kept by the server, by digest ------------------------------------------

def test_a_module_image_sent_with_its_digest_is_loaded_by_it_later(tmp_path):
    from phos.gpu_server.worker.module_cache import ModuleCache, image_digest
    cache = ModuleCache(str(tmp_path), 1 << 30)
    image = compile_ptx("dynshared.cu").encode()
    digest = image_digest(image)
    first, second = Session(EmuBackend(), 7, b"t" * 16), Session(EmuBackend(), 8, b"t" * 16)
    first.modules = second.modules = cache             # two contexts of one server
    with pytest.raises(CudaError) as e:
        calls.module_load(second, Args(payload=0, digest=digest), [])
    assert e.value.status == CUresult.CUDA_ERROR_NOT_FOUND
    calls.module_load(first, Args(payload=1, digest=digest), [image])
    module = calls.module_load(second, Args(payload=0, digest=digest), [])["u64s"][0]
    assert calls.module_get_function(second, Args(module=module, name="reverse_blocks"), [])["u64s"][0]


def test_a_module_image_that_does_not_match_its_digest_is_refused_and_not_kept(tmp_path):
    from phos.gpu_server.worker.module_cache import ModuleCache, image_digest
    s = Session(EmuBackend(), 7, b"t" * 16)
    s.modules = ModuleCache(str(tmp_path), 1 << 30)
    image = compile_ptx("dynshared.cu").encode()
    wrong = image_digest(b"another image")
    with pytest.raises(CudaError, match="does not match its digest"):
        calls.module_load(s, Args(payload=1, digest=wrong), [image])
    assert os.listdir(tmp_path) == []
