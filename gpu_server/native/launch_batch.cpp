// The context worker's launch hot path: a launchBatch's records (schema/phos.capnp, "Launch
// batches"; schema/wire.py, LAUNCH_RECORD) checked and launched with one call from Python.
//
// Why native: a launch through the worker's Python (decode, check, ctypes into the driver) costs
// more than NVIDIA's runtime's own launch (perf/RESULTS.md, bench_launch_decode).
// gpu_server/backends/native_launch.py owns the policy: it registers the context's functions and streams
// here as batches name them, hands over a restored context's moved ranges, and keeps every other
// case (a checkpoint or restore watching the launches, a record this code refuses) on the Python
// path, which decides what such records mean and how their errors read.
//
// No CUDA header or library: the driver's cuLaunchKernelEx comes as a function pointer, so CI
// (no GPU) tests this file with a stand-in driver (tests/native/test_native_launch.py).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

struct LaunchAttribute {        // CUlaunchAttribute: an id, then a 64-byte value union
    unsigned id;
    char pad[4];
    unsigned value[16];
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute");

struct LaunchConfig {           // CUlaunchConfig
    unsigned grid[3], block[3], shared;
    void* stream;
    LaunchAttribute* attrs;
    unsigned num_attrs;
};

using LaunchEx = int (*)(const LaunchConfig*, void* function, void** params, void** extra);

constexpr unsigned kAttributeCooperative = 2;       // CU_LAUNCH_ATTRIBUTE_COOPERATIVE
constexpr unsigned kAttributeClusterDimension = 4;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
constexpr uint32_t kOptionCooperative = 1u << 24;   // schema/wire.py, LAUNCH_COOPERATIVE
constexpr size_t kHead = 52;                        // schema/wire.py, LAUNCH_RECORD.size

struct Function {
    void* handle;
    uint32_t param_bytes;
    std::vector<uint32_t> offsets;     // each parameter's offset in the packed parameter bytes
};

struct Record {                 // one record, checked: its head read field by field (the blob is unaligned)
    const Function* function;   // its ids found (check): the registry does not change while a batch runs
    void* stream;
    uint32_t grid[3], block[3], shared, options;
    uint32_t param_bytes;
    const unsigned char* params;
};

struct Launcher {
    LaunchEx launch;
    std::unordered_map<uint64_t, Function> functions;
    std::unordered_map<uint64_t, void*> streams;     // the aliases of the default stream map to nullptr
    std::vector<Record> records;                     // the batch being run, reused
    std::vector<uint64_t> params;                    // a record's parameters, 8-byte aligned
    std::vector<void*> pointers;                     // the driver's kernelParams
    // A restored context's moved ranges (snapshot/relocations.py: disjoint, sorted by start)
    std::vector<uint64_t> move_starts, move_ends, move_shifts;
};

// Each 8-byte word of a launch's parameters that lies in a moved range, pointed at the same
// place in its new one (Relocations.apply's rule, so that both paths launch the same bytes).
void relocate(const Launcher& l, uint64_t* words, size_t count) {
    for (size_t w = 0; w < count; w++) {
        auto it = std::upper_bound(l.move_starts.begin(), l.move_starts.end(), words[w]);
        if (it == l.move_starts.begin()) continue;
        const size_t i = size_t(it - l.move_starts.begin()) - 1;
        if (words[w] < l.move_ends[i]) words[w] += l.move_shifts[i];
    }
}

template <typename T>
T read(const unsigned char* at) {
    T value;
    std::memcpy(&value, at, sizeof value);
    return value;
}

// Outcomes (gpu_server/backends/native_launch.py reads them)
enum : int {
    kLaunched = 0,          // every record from `first` on ran; *count: the records in the batch
    kUnknownFunction = 1,   // nothing ran: record *at names function *value, not registered
    kUnknownStream = 2,     // nothing ran: record *at names stream *value, not registered
    kRefused = 3,           // nothing ran: a record for the Python path to judge (malformed, or a check fails)
    kDriverError = 4,       // records before *at ran; *at failed with CUresult *value; later ones did not run
};

// Reads and checks every record before any runs, so that a batch the Python path must judge
// runs nothing here. The checks are calls.run_launch's: a known function taking that many
// parameter bytes, a non-zero grid and block of at most 1024 threads, a known stream.
int check(Launcher& l, const unsigned char* blob, size_t size, uint64_t* at, uint64_t* value) {
    l.records.clear();
    for (size_t off = 0; off < size;) {
        if (size - off < kHead) return kRefused;
        Record r;
        const unsigned char* h = blob + off;
        const uint64_t function = read<uint64_t>(h), stream = read<uint64_t>(h + 40);
        for (int i = 0; i < 3; i++) r.grid[i] = read<uint32_t>(h + 8 + 4 * i);
        for (int i = 0; i < 3; i++) r.block[i] = read<uint32_t>(h + 20 + 4 * i);
        r.shared = read<uint32_t>(h + 32);
        r.options = read<uint32_t>(h + 36);
        r.param_bytes = read<uint32_t>(h + 48);
        if (r.param_bytes > size - off - kHead) return kRefused;
        r.params = h + kHead;
        off += kHead + r.param_bytes;
        *at = l.records.size();
        auto fn = l.functions.find(function);
        if (fn == l.functions.end()) {
            *value = function;
            return kUnknownFunction;
        }
        auto st = l.streams.find(stream);      // the default stream's ids are registered too
        if (st == l.streams.end()) {
            *value = stream;
            return kUnknownStream;
        }
        r.function = &fn->second;
        r.stream = st->second;
        const uint64_t threads = uint64_t(r.block[0]) * r.block[1] * r.block[2];
        if (!(r.grid[0] && r.grid[1] && r.grid[2] && threads) || threads > 1024 || r.param_bytes != fn->second.param_bytes)
            return kRefused;
        l.records.push_back(r);
    }
    return l.records.empty() ? kRefused : kLaunched;
}

int run(Launcher& l, uint64_t first, uint64_t* at, uint64_t* value) {
    LaunchAttribute attrs[2];
    for (uint64_t i = first; i < l.records.size(); i++) {
        const Record& r = l.records[i];
        const Function& fn = *r.function;
        LaunchConfig config{{r.grid[0], r.grid[1], r.grid[2]}, {r.block[0], r.block[1], r.block[2]}, r.shared,
                            r.stream, attrs, 0};
        const uint32_t cluster[3] = {r.options & 0xFF, (r.options >> 8) & 0xFF, (r.options >> 16) & 0xFF};
        if (cluster[0] || cluster[1] || cluster[2]) {   // as cuda.py's _launch_attributes: 0 stands for 1
            LaunchAttribute& a = attrs[config.num_attrs++];
            std::memset(&a, 0, sizeof a);
            a.id = kAttributeClusterDimension;
            for (int d = 0; d < 3; d++) a.value[d] = cluster[d] ? cluster[d] : 1;
        }
        if (r.options & kOptionCooperative) {
            LaunchAttribute& a = attrs[config.num_attrs++];
            std::memset(&a, 0, sizeof a);
            a.id = kAttributeCooperative;
            a.value[0] = 1;
        }
        l.params.resize(r.param_bytes / 8 + 1);
        std::memcpy(l.params.data(), r.params, r.param_bytes);
        if (!l.move_starts.empty()) relocate(l, l.params.data(), r.param_bytes / 8);
        l.pointers.resize(fn.offsets.size() + 1);
        for (size_t p = 0; p < fn.offsets.size(); p++)
            l.pointers[p] = reinterpret_cast<unsigned char*>(l.params.data()) + fn.offsets[p];
        const int err = l.launch(&config, fn.handle, fn.offsets.empty() ? nullptr : l.pointers.data(), nullptr);
        if (err) {
            *at = i;
            *value = uint64_t(err);
            return kDriverError;
        }
    }
    return kLaunched;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* phos_launcher_new(void* launch_kernel_ex) {
    return new Launcher{reinterpret_cast<LaunchEx>(launch_kernel_ex), {}, {}, {}, {}, {}, {}, {}, {}};
}

__attribute__((visibility("default"))) void phos_launcher_free(void* launcher) { delete static_cast<Launcher*>(launcher); }

// A function the batches may name: its driver handle, parameter bytes and each parameter's offset.
// Offsets past the parameter bytes are refused (returns 1).
__attribute__((visibility("default"))) int phos_launcher_function(void* launcher, uint64_t id, void* handle, uint32_t param_bytes,
                                                                  const uint32_t* offsets, uint32_t count) {
    for (uint32_t i = 0; i < count; i++)
        if (offsets[i] >= param_bytes) return 1;
    static_cast<Launcher*>(launcher)->functions[id] = Function{handle, param_bytes, std::vector<uint32_t>(offsets, offsets + count)};
    return 0;
}

// A stream the batches may name (handle nullptr: an alias of the default stream).
__attribute__((visibility("default"))) void phos_launcher_stream(void* launcher, uint64_t id, void* handle) {
    static_cast<Launcher*>(launcher)->streams[id] = handle;
}

// The context's moved ranges, replacing the last ones (count 0: none). Starts must be sorted
// and the ranges disjoint, as Relocations makes them; refused otherwise (returns 1).
__attribute__((visibility("default"))) int phos_launcher_moves(void* launcher, const uint64_t* starts, const uint64_t* ends,
                                                               const uint64_t* shifts, uint64_t count) {
    for (uint64_t i = 0; i < count; i++)
        if (starts[i] >= ends[i] || (i && starts[i] < ends[i - 1])) return 1;
    auto& l = *static_cast<Launcher*>(launcher);
    l.move_starts.assign(starts, starts + count);
    l.move_ends.assign(ends, ends + count);
    l.move_shifts.assign(shifts, shifts + count);
    return 0;
}

// An id the context dropped or replaced: later batches naming it go back to asking.
__attribute__((visibility("default"))) void phos_launcher_forget(void* launcher, uint64_t id) {
    auto& l = *static_cast<Launcher*>(launcher);
    l.functions.erase(id);
    l.streams.erase(id);
}

// Checks the whole batch, then launches its records from `first` on (a batch resumed after a
// driver error). *count: the records in the batch; *at and *value as the outcome says.
__attribute__((visibility("default"))) int phos_launcher_run(void* launcher, const unsigned char* blob, size_t size, uint64_t first,
                                                             uint64_t* count, uint64_t* at, uint64_t* value) {
    auto& l = *static_cast<Launcher*>(launcher);
    const int checked = check(l, blob, size, at, value);
    *count = l.records.size();
    if (checked != kLaunched) return checked;
    return run(l, first, at, value);
}

}  // extern "C"
