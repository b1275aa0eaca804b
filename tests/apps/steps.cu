// A program that runs on by itself, for whole-process checkpoints (tests/e2e/test_process.py):
// `steps TOTAL DELAY_MS` runs TOTAL steps of a kernel over device memory the previous steps
// wrote, with a host-side running sum (CPU state a restore must bring back), a second thread,
// and a child process that waits to be told to end (a dump and a restore carry the whole tree);
// after each step it prints the step, the device's checksum and the host's, then sleeps
// DELAY_MS. A checkpoint, restore or migration at any step must leave the output exactly that
// of an uninterrupted run.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <atomic>
#include <vector>
#include "common.h"

__global__ void step(float* x, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.5f + (float)((i + k) % 17);
}

int main(int argc, char** argv) {
    const int total = argc > 1 ? atoi(argv[1]) : 40;
    const int delay_ms = argc > 2 ? atoi(argv[2]) : 50;
    const pid_t child = fork();   // before any CUDA call: the child holds no connection of the stub's
    if (child == 0) {
        while (true) pause();     // until the parent ends it
    }
    const int n = 1 << 16;
    std::vector<float> host(n, 1.0f);
    float* x;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMemcpy(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    std::atomic<int> seen{0};
    std::atomic<bool> done{false};
    std::thread counter([&] {   // a second thread, which a dump and a restore must carry
        while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    });
    double running = 0;
    for (int k = 0; k < total; k++) {
        step<<<(n + 255) / 256, 256>>>(x, n, k);
        CHECK(cudaMemcpy(host.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost));
        double sum = 0;
        for (int i = 0; i < n; i++) sum += host[i];
        running += sum;
        seen++;
        printf("step %d %.6f %.6f\n", k, sum, running);
        fflush(stdout);
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    }
    done = true;
    counter.join();
    CHECK(cudaFree(x));
    int status = 0;
    kill(child, SIGTERM);
    waitpid(child, &status, 0);
    printf("DONE %d, the child ended by signal %d\n", seen.load(), WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    return 0;
}
