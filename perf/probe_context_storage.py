"""What a driver's context-local storage, context checks and private tables answer (run it on the
real driver, or on phos's: python3 perf/probe_context_storage.py [path/to/libcuda.so.1]); the
export tables in client_stub/native/driver_export_tables.cpp follow what the H200's driver said."""
import ctypes, subprocess, sys
lib = sys.argv[1] if len(sys.argv) > 1 else subprocess.run("ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}'", shell=True, capture_output=True, text=True).stdout.strip()
cuda = ctypes.CDLL(lib)
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
def table(uuid):
    t = ctypes.c_void_p()
    r = cuda.cuGetExportTable(ctypes.byref(t), ctypes.c_char_p(bytes.fromhex(uuid)))
    return t.value if r == 0 else None
cls = table("c693336e1121df11a8c368f355d89593")
slot = lambda t, i: ctypes.c_void_p.from_address(t + 8 * i).value
put = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(slot(cls, 0))
delete = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(slot(cls, 1))
get = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(slot(cls, 2))
value = ctypes.c_void_p(0)
print("cls slot 3:", slot(cls, 3))
print("get missing (ctx NULL):", get(ctypes.byref(value), None, 0x1234), value.value)
print("get missing (ctx):", get(ctypes.byref(value), ctx, 0x1234), value.value)
print("delete missing:", delete(ctx, 0x1234))
print("put:", put(ctx, 0x1234, 0x5678, None))
print("get:", get(ctypes.byref(value), ctx, 0x1234), value.value)
print("put again:", put(ctx, 0x1234, 0x9999, None))
print("get:", get(ctypes.byref(value), None, 0x1234), value.value)
print("delete:", delete(ctx, 0x1234))
print("get deleted:", get(ctypes.byref(value), ctx, 0x1234))
chk = table("263e88607cd2614392f6bbd5006dfa7e")
c2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p))(slot(chk, 2))
r1, r2 = ctypes.c_uint(77), ctypes.c_void_p(77)
print("context check:", c2(ctx, ctypes.byref(r1), ctypes.byref(r2)), r1.value, r2.value)
print("context check NULL:", c2(None, ctypes.byref(r1), ctypes.byref(r2)), r1.value, r2.value)
c3 = ctypes.CFUNCTYPE(ctypes.c_uint)(slot(chk, 3))
print("check 3:", c3())
print("checks slots:", [hex(slot(chk, i) or 0) != "0x0" for i in range(15)])
ext = table("b10541e1f7c7c74a9f64f223be99f1e2")
print("device extended slots:", [i for i in range(31) if slot(ext, i)])
rt = table("6bd5fb6c5bf4e74a8987d93912fd9df9")
print("runtime slots:", [i for i in range(13) if slot(rt, i)])
tls = table("42d85a8123f6cb478298f6e78a3aecdc")
print("tools tls slots:", [i for i in range(3) if slot(tls, i)])
hooks = table("a094798c2e742e7493f20800200c0a66")
print("hooks slots:", [i for i in range(7) if slot(hooks, i)])
