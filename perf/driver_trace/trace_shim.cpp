// A libcuda.so.1 over another one (REAL_LIBCUDA: NVIDIA's driver, or phos's stub), for the same
// program over both, to compare what NVIDIA's runtime and libraries ask and are answered:
// - every call made through cuGetProcAddress's answers is named with its result ("trace: call");
// - the calls defined here print their arguments and answers (device attributes, limits,
//   occupancy, kernels, library loads, ...), whichever way they were found;
// - every export table but the two whose addresses the runtime hashes is handed out as a copy
//   whose slots print their first four arguments, the 8 bytes at each readable one after the
//   call, and the result (table 1734dc26: the objects its slots hand out, too).
// Build with build.sh; each line it writes on stderr starts with "trace: ".
#include <cuda.h>
#include <dlfcn.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include "../../client_stub/native/call_trace.h"
#undef cuGetProcAddress

void* real_driver() {
    static void* h = dlopen(getenv("REAL_LIBCUDA"), RTLD_NOW | RTLD_LOCAL);
    return h;
}
template <typename F> F real(const char* n) { return reinterpret_cast<F>(dlsym(real_driver(), n)); }
#define P(...) fprintf(stderr, "trace: " __VA_ARGS__)
static void report(const char* name, int result) { fprintf(stderr, "trace: call %s -> %d\n", name, result); }


#include <sys/uio.h>
#include <unistd.h>
#include <utility>
// A copy of each export table (but the runtime interface and the integrity check, whose
// addresses the runtime hashes) whose slots print their six register arguments, what 8 bytes
// at each readable argument hold after the call, and the result.
static bool peek(uint64_t addr, uint64_t* out) {
    iovec local{out, 8}, remote{reinterpret_cast<void*>(addr), 8};
    return addr > 4096 && process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 8;
}
using SlotFn = uint64_t (*)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
struct Wrapped { char name[9]; const void* orig[512]; const void* copy[512]; };
static Wrapped g_tables[16];
static int g_count = 0;
template <int T, int S>
uint64_t slot_fn(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e, uint64_t f) {
    uint64_t r = reinterpret_cast<SlotFn>(const_cast<void*>(g_tables[T].orig[S]))(a, b, c, d, e, f);
    uint64_t args[6] = {a, b, c, d, e, f};
    fprintf(stderr, "trace: table %s slot %d (%lx, %lx, %lx, %lx) -> %lx;", g_tables[T].name, S, a, b, c, d, r);
    for (int i = 0; i < 4; i++) { uint64_t v; if (peek(args[i], &v)) fprintf(stderr, " *a%d=%lx", i, v); }
    fprintf(stderr, "\n");
    if (!strcmp(g_tables[T].name, "1734dc26")) {   // what its objects hold
        for (int i = 0; i < 4; i++) {
            uint64_t v, w;
            if (!peek(args[i], &v)) continue;
            fprintf(stderr, "trace:   a%d @%lx:", i, args[i]);
            for (int k = 0; k < 24 && peek(args[i] + 8 * k, &w); k++) fprintf(stderr, " %lx", w);
            fprintf(stderr, "\n");
            if (peek(v, &w)) {
                fprintf(stderr, "trace:   *a%d @%lx:", i, v);
                for (int k = 0; k < 24 && peek(v + 8 * k, &w); k++) fprintf(stderr, " %lx", w);
                fprintf(stderr, "\n");
            }
        }
    }
    return r;
}
template <int T, size_t... S>
void fill_slots(size_t n, size_t first, std::index_sequence<S...>) {
    ((S < n && g_tables[T].orig[S] && S >= first ? g_tables[T].copy[S] = reinterpret_cast<const void*>(&slot_fn<T, int(S)>) : nullptr), ...);
}
template <size_t... T>
void fill_table(int t, size_t n, size_t first, std::index_sequence<T...>) { ((int(T) == t ? fill_slots<int(T)>(n, first, std::make_index_sequence<64>()) : void()), ...); }
static const void* wrapped_table(const unsigned char* id, const void* table) {
    char name[9]; snprintf(name, 9, "%02x%02x%02x%02x", id[0], id[1], id[2], id[3]);
    if (!strcmp(name, "6bd5fb6c") || !strcmp(name, "d4082055") || getenv("TRACE_NO_TABLES")) return table;
    for (int i = 0; i < g_count; i++) if (!strcmp(g_tables[i].name, name)) return g_tables[i].copy;
    if (g_count == 16) return table;
    Wrapped& w = g_tables[g_count];
    const void* const* slots = static_cast<const void* const*>(table);
    bool sized = strcmp(name, "c693336e") != 0;   // context-local storage has no size slot
    size_t n = sized ? reinterpret_cast<uintptr_t>(slots[0]) / 8 : 4;
    if (n > 64) n = 64;
    memcpy(w.name, name, 9);
    for (size_t i = 0; i < n; i++) w.orig[i] = w.copy[i] = slots[i];
    fill_table(g_count, n, sized ? 1 : 0, std::make_index_sequence<16>());
    P("table %s: %zu slots wrapped\n", name, n);
    g_count++;
    return w.copy;
}

#define REAL(name) static auto r = real<decltype(&name)>(#name)
extern "C" {
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
    REAL(cuDeviceGetAttribute); CUresult e = r(v, a, d); P("cuDeviceGetAttribute(%d, dev %d) -> %d = %d\n", a, d, e, e ? 0 : *v); return e; }
CUresult cuLibraryGetGlobal(CUdeviceptr* p, size_t* s, CUlibrary l, const char* n) {
    REAL(cuLibraryGetGlobal); CUresult e = r(p, s, l, n); P("cuLibraryGetGlobal(%s) -> %d ptr %llx size %zu\n", n, e, p ? (unsigned long long)*p : 0ull, s ? *s : 0); return e; }
CUresult cuLibraryGetKernel(CUkernel* k, CUlibrary l, const char* n) {
    REAL(cuLibraryGetKernel); CUresult e = r(k, l, n); P("cuLibraryGetKernel(%s) -> %d\n", n, e); return e; }
CUresult cuKernelGetAttribute(int* v, CUfunction_attribute a, CUkernel k, CUdevice d) {
    REAL(cuKernelGetAttribute); CUresult e = r(v, a, k, d); P("cuKernelGetAttribute(%d) -> %d = %d\n", a, e, e ? 0 : *v); return e; }
CUresult cuKernelSetAttribute(CUfunction_attribute a, int v, CUkernel k, CUdevice d) {
    REAL(cuKernelSetAttribute); CUresult e = r(a, v, k, d); P("cuKernelSetAttribute(%d, %d) -> %d\n", a, v, e); return e; }
CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction f) {
    REAL(cuFuncGetAttribute); CUresult e = r(v, a, f); P("cuFuncGetAttribute(%d) -> %d = %d\n", a, e, e ? 0 : *v); return e; }
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
    REAL(cuFuncSetAttribute); CUresult e = r(f, a, v); P("cuFuncSetAttribute(%d, %d) -> %d\n", a, v, e); return e; }
CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* s, CUfunction f, int n, int b) {
    REAL(cuOccupancyAvailableDynamicSMemPerBlock); CUresult e = r(s, f, n, b); P("cuOccupancyAvailableDynamicSMemPerBlock(%d, %d) -> %d = %zu\n", n, b, e, *s); return e; }
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* v, CUfunction f, int b, size_t s, unsigned fl) {
    REAL(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags); CUresult e = r(v, f, b, s, fl); P("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(%d, %zu, %u) -> %d = %d\n", b, s, fl, e, *v); return e; }
CUresult cuOccupancyMaxActiveClusters(int* v, CUfunction f, const CUlaunchConfig* c) {
    REAL(cuOccupancyMaxActiveClusters); CUresult e = r(v, f, c);
    P("cuOccupancyMaxActiveClusters(grid %u %u %u block %u %u %u smem %u attrs %u", c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, c->numAttrs);
    for (unsigned i = 0; i < c->numAttrs; i++) fprintf(stderr, " [%d: %u %u %u]", c->attrs[i].id, c->attrs[i].value.clusterDim.x, c->attrs[i].value.clusterDim.y, c->attrs[i].value.clusterDim.z);
    fprintf(stderr, ") -> %d = %d\n", e, e ? 0 : *v); return e; }
CUresult cuLibraryLoadData(CUlibrary* l, const void* code, CUjit_option* jo, void** jv, unsigned nj, CUlibraryOption* lo, void** lv, unsigned nl) {
    REAL(cuLibraryLoadData); CUresult e = r(l, code, jo, jv, nj, lo, lv, nl);
    P("cuLibraryLoadData(magic %08x, jit %u, lib %u", *(const unsigned*)code, nj, nl);
    for (unsigned i = 0; i < nl; i++) fprintf(stderr, " [%d=%p]", lo[i], lv ? lv[i] : nullptr);
    fprintf(stderr, ") -> %d\n", e); return e; }
CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode* m) {
    REAL(cuModuleGetLoadingMode); CUresult e = r(m);
    P("cuModuleGetLoadingMode -> %d = %d\n", e, *m); return e; }
CUresult cuCtxGetLimit(size_t* v, CUlimit l) {
    REAL(cuCtxGetLimit); CUresult e = r(v, l); P("cuCtxGetLimit(%d) -> %d = %zu\n", l, e, e ? 0 : *v); return e; }
CUresult cuDeviceTotalMem_v2(size_t* v, CUdevice d) {
    REAL(cuDeviceTotalMem_v2); CUresult e = r(v, d); P("cuDeviceTotalMem -> %d = %zu\n", e, *v); return e; }
CUresult cuDeviceGetName(char* n, int len, CUdevice d) {
    REAL(cuDeviceGetName); CUresult e = r(n, len, d); P("cuDeviceGetName(%d) -> %d = %s\n", len, e, n); return e; }
CUresult cuCtxGetStreamPriorityRange(int* a, int* b) {
    REAL(cuCtxGetStreamPriorityRange); CUresult e = r(a, b); P("cuCtxGetStreamPriorityRange -> %d = %d %d\n", e, a ? *a : 0, b ? *b : 0); return e; }
CUresult cuDriverGetVersion(int* v) {
    REAL(cuDriverGetVersion); CUresult e = r(v); P("cuDriverGetVersion -> %d = %d\n", e, *v); return e; }
CUresult cuGetExportTable(const void** t, const CUuuid* id) {
    REAL(cuGetExportTable); CUresult e = r(t, id);
    const unsigned char* b = (const unsigned char*)id->bytes;
    P("cuGetExportTable(%02x%02x%02x%02x) -> %d", b[0], b[1], b[2], b[3], e);
    for (int i = 0; i < 16; i++) fprintf(stderr, " %02x", b[i]);
    fprintf(stderr, "\n");
    if (e == CUDA_SUCCESS && *t) *t = wrapped_table(b, *t);
    return e; }
CUresult cuCtxGetDevice(CUdevice* d) {
    REAL(cuCtxGetDevice); CUresult e = r(d); if (e) P("cuCtxGetDevice -> %d\n", e); return e; }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t s) {
    REAL(cuMemAlloc_v2); CUresult e = r(p, s); P("cuMemAlloc(%zu) -> %d = %llx\n", s, e, (unsigned long long)*p); return e; }
CUresult cuPointerGetAttribute(void* d, CUpointer_attribute a, CUdeviceptr p) {
    REAL(cuPointerGetAttribute); CUresult e = r(d, a, p); P("cuPointerGetAttribute(%d, %llx) -> %d\n", a, (unsigned long long)p, e); return e; }
CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute* a, void** d, CUdeviceptr p) {
    REAL(cuPointerGetAttributes); CUresult e = r(n, a, d, p); P("cuPointerGetAttributes(%u, %llx) -> %d\n", n, (unsigned long long)p, e); return e; }
CUresult cuFuncGetName(const char** n, CUfunction f) {
    REAL(cuFuncGetName); CUresult e = r(n, f); P("cuFuncGetName -> %d = %s\n", e, e ? "" : *n); return e; }
CUresult cuKernelGetName(const char** n, CUkernel f) {
    REAL(cuKernelGetName); CUresult e = r(n, f); P("cuKernelGetName -> %d = %s\n", e, e ? "" : *n); return e; }
CUresult cuLibraryGetKernelCount(unsigned* c, CUlibrary l) {
    REAL(cuLibraryGetKernelCount); CUresult e = r(c, l); P("cuLibraryGetKernelCount -> %d = %u\n", e, e ? 0 : *c); return e; }
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** p, void** x) {
    REAL(cuLaunchKernelEx); CUresult e = r(c, f, p, x);
    P("cuLaunchKernelEx(grid %u %u %u block %u %u %u smem %u attrs %u) -> %d\n", c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, c->numAttrs, e); return e; }
}

static const char* const kMine[] = {"cuDeviceGetAttribute", "cuLibraryGetGlobal", "cuLibraryGetKernel", "cuKernelGetAttribute",
    "cuKernelSetAttribute", "cuFuncGetAttribute", "cuFuncSetAttribute", "cuOccupancyAvailableDynamicSMemPerBlock",
    "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", "cuOccupancyMaxActiveClusters", "cuLibraryLoadData",
    "cuModuleGetLoadingMode", "cuCtxGetLimit", "cuDeviceTotalMem_v2", "cuDeviceGetName", "cuCtxGetStreamPriorityRange",
    "cuDriverGetVersion", "cuGetExportTable", "cuCtxGetDevice", "cuMemAlloc_v2", "cuPointerGetAttribute", "cuPointerGetAttributes",
    "cuFuncGetName", "cuKernelGetName", "cuLibraryGetKernelCount", "cuLaunchKernelEx"};

extern "C" CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags);
extern "C" CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, CUdriverProcAddressQueryResult* status) {
    using Lookup = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    CUresult r = reinterpret_cast<Lookup>(dlsym(real_driver(), "cuGetProcAddress_v2"))(symbol, pfn, version, flags, status);
    if (r != CUDA_SUCCESS || !pfn || !*pfn) { P("lookup %s (%d, %llu) -> %d\n", symbol ? symbol : "(null)", version, (unsigned long long)flags, r); return r; }
    if (strcmp(symbol, "cuGetProcAddress") == 0) { *pfn = (void*)&cuGetProcAddress_v2; return r; }
    for (const char* m : kMine)
        if (*pfn == dlsym(real_driver(), m)) { *pfn = dlsym(RTLD_DEFAULT, m); return r; }
    *pfn = phos::trace::wrap(symbol, *pfn, &report);
    return r;
}
extern "C" CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}
