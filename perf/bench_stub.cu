// phos native stub benchmark: one program, run natively and through phos (see bench_stub.sh).
//
//   sync_rtt_us         cudaDeviceSynchronize on an idle device: one round trip to the server
//   launch_us           per launch: 10,000 empty launches then one synchronize, divided by 10,000
//   launch_enqueue_us   the same launches, without the final synchronize: the caller's cost
//   copy_<kind>_<dir>_<size>_GBps
//                       cudaMemcpy bandwidth, pinned (cudaMallocHost) or pageable (malloc),
//                       host->device and device->host, at 1 MiB and 256 MiB
//   copy_sweep_<kind>_<dir>_<bytes>
//                       the same bandwidth over sizes from --sweep-min-kib (64 KiB) up to
//                       --big-mib, four times larger each (perf/plots.py draws it; 0: no sweep)
//
// Prints one `name value` line per figure, so runs can be joined by name.
//   bench_stub [--big-mib N] [--launches N] [--rtt N] [--sweep-min-kib N] [--settle-ms N]
// --settle-ms (250): wait this long after creating the context, natively and through phos alike.
// The figures are steady-state ones: a phos worker pins the client's staging area in the
// background for ~100 ms after it attaches, and each piece it pins holds the driver's lock
// (gpu_server/backends/cuda.py, register_host) that the launches and syncs measured here take too.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(call)                                                                           \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "bench_stub: %s failed: %s\n", #call, cudaGetErrorString(e_));    \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

__global__ void empty() {}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static void sync_round_trip(int iterations) {
    for (int i = 0; i < 100; i++) CHECK(cudaDeviceSynchronize());   // warm up
    std::vector<double> samples;
    samples.reserve(iterations);
    for (int i = 0; i < iterations; i++) {
        auto t = Clock::now();
        CHECK(cudaDeviceSynchronize());
        samples.push_back(seconds_since(t) * 1e6);
    }
    printf("sync_rtt_us %.2f\n", median(samples));
}

static void launch_rate(int launches) {
    for (int i = 0; i < 100; i++) empty<<<1, 32>>>();
    CHECK(cudaDeviceSynchronize());
    auto t = Clock::now();
    for (int i = 0; i < launches; i++) empty<<<1, 32>>>();
    const double enqueue = seconds_since(t);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    printf("launch_us %.3f\n", seconds_since(t) * 1e6 / launches);
    printf("launch_enqueue_us %.3f\n", enqueue * 1e6 / launches);
}

// named: also print the figure under its table name (the table shows 1 MiB and --big-mib alone)
static void bandwidth(const char* kind, bool pinned, size_t bytes, int repeats, bool named) {
    void* host = nullptr;
    if (pinned) CHECK(cudaMallocHost(&host, bytes));
    else host = malloc(bytes);
    memset(host, 1, bytes);
    void* device = nullptr;
    CHECK(cudaMalloc(&device, bytes));
    const std::string size = bytes >= (1u << 20) ? std::to_string(bytes >> 20) + "MiB" : std::to_string(bytes) + "B";
    for (int dir = 0; dir < 2; dir++) {
        const bool h2d = dir == 0;
        auto once = [&] {
            if (h2d) CHECK(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
            else CHECK(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
        };
        once();
        CHECK(cudaDeviceSynchronize());
        std::vector<double> rates;
        for (int r = 0; r < repeats; r++) {
            auto t = Clock::now();
            once();
            CHECK(cudaDeviceSynchronize());   // a host->device copy may return before it lands
            rates.push_back(bytes / seconds_since(t) / 1e9);
        }
        const double rate = median(rates);
        printf("copy_sweep_%s_%s_%zu %.3f\n", kind, h2d ? "h2d" : "d2h", bytes, rate);
        if (named) printf("copy_%s_%s_%s_GBps %.2f\n", kind, h2d ? "h2d" : "d2h", size.c_str(), rate);
    }
    CHECK(cudaFree(device));
    if (pinned) CHECK(cudaFreeHost(host));
    else free(host);
}

int main(int argc, char** argv) {
    size_t big_mib = 256, sweep_min_kib = 64;
    int launches = 10000, rtt = 2000, settle_ms = 250;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--big-mib")) big_mib = strtoul(argv[i + 1], nullptr, 10);
        else if (!strcmp(argv[i], "--launches")) launches = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rtt")) rtt = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--sweep-min-kib")) sweep_min_kib = strtoul(argv[i + 1], nullptr, 10);
        else if (!strcmp(argv[i], "--settle-ms")) settle_ms = atoi(argv[i + 1]);
    }
    CHECK(cudaFree(nullptr));   // create the context outside the measurements
    std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
    sync_round_trip(rtt);
    launch_rate(launches);
    const size_t mib = size_t(1) << 20, big = big_mib << 20;
    std::vector<size_t> sizes = {mib, big};
    for (size_t b = sweep_min_kib << 10; b && b <= big; b *= 4) sizes.push_back(b);
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    for (size_t bytes : sizes) {
        const int repeats = bytes <= (8u << 20) ? 50 : 5;
        bandwidth("pinned", true, bytes, repeats, bytes == mib || bytes == big);
        bandwidth("pageable", false, bytes, repeats, bytes == mib || bytes == big);
    }
    return 0;
}
