"""client_stub/native/parallel_copy.cpp on its own: the host copies of bulk bytes that the stub
splits between PHOS_COPY_THREADS threads (staged chunks into and out of the staging slots,
payloads, Replies). A small C++ program built from that file alone checks every byte over sizes,
offsets and thread counts, that no thread starts before the first large copy, that the helpers
block the application's signals, that copies from several threads at once are right, that a
forked child (forked while another thread copies too) copies right with helpers of its own, and
that the process exits while helpers wait or copy. tests/native/test_stub.py
(test_large_pageable_copies_on_several_threads) runs the stub's staged copies with it.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "client_stub", "native")
CXX = os.environ.get("CXX") or shutil.which("g++")

CHECK_CPP = r"""
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "parallel_copy.h"

using phos::parallel_copy;

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i >> 20) * 29 + (i >> 12) * 7 + i * 13 + seed); }

static int fails = 0;
#define EXPECT(cond, ...) do { if (!(cond)) { fails++; printf("FAIL line %d: ", __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)

// Copies n bytes from src + so to dst + do_ with `threads` threads; checks them and the guard bytes around.
static bool copy_checked(size_t n, size_t so, size_t do_, long threads, unsigned seed) {
    std::vector<unsigned char> src(n + so + 64), dst(n + do_ + 64, 0xee);
    for (size_t i = 0; i < n; i++) src[so + i] = pattern(i, seed);
    parallel_copy(dst.data() + do_, src.data() + so, n, threads);
    for (size_t i = 0; i < do_; i++) if (dst[i] != 0xee) return false;
    for (size_t i = 0; i < n; i++) if (dst[do_ + i] != pattern(i, seed)) return false;
    for (size_t i = do_ + n; i < dst.size(); i++) if (dst[i] != 0xee) return false;
    return true;
}

static std::vector<std::string> task_names() {
    std::vector<std::string> names;
    if (DIR* d = opendir("/proc/self/task")) {
        while (dirent* e = readdir(d)) {
            if (e->d_name[0] == '.') continue;
            char buf[64] = {0};
            FILE* f = fopen(("/proc/self/task/" + std::string(e->d_name) + "/comm").c_str(), "r");
            if (f) { if (!fgets(buf, sizeof buf, f)) buf[0] = 0; fclose(f); }
            buf[strcspn(buf, "\n")] = 0;
            names.push_back(std::string(e->d_name) + " " + buf);
        }
        closedir(d);
    }
    return names;
}

static int helpers() {
    int n = 0;
    for (auto& t : task_names()) n += t.find(" phos-copy") != std::string::npos;
    return n;
}

// Every helper blocks SIGINT, SIGTERM, SIGUSR1 (the application's handlers run on its threads).
static bool helpers_block_signals() {
    int seen = 0;
    for (auto& t : task_names()) {
        if (t.find(" phos-copy") == std::string::npos) continue;
        FILE* f = fopen(("/proc/self/task/" + t.substr(0, t.find(' ')) + "/status").c_str(), "r");
        if (!f) return false;
        char line[256];
        unsigned long long blocked = 0;
        while (fgets(line, sizeof line, f)) if (!strncmp(line, "SigBlk:", 7)) blocked = strtoull(line + 7, nullptr, 16);
        fclose(f);
        for (int sig : {SIGINT, SIGTERM, SIGUSR1}) if (!(blocked & (1ull << (sig - 1)))) return false;
        if (blocked & (1ull << (SIGSEGV - 1))) return false;   // a fault stays a fault
        seen++;
    }
    return seen > 0;
}

int main(int argc, char** argv) {
    const size_t MiB = 1 << 20, min = phos::kParallelCopyMin;
    // below the threshold, or one thread: memcpy on the caller's, and no thread starts
    EXPECT(copy_checked(min - 1, 1, 2, 4, 1), "small copy");
    EXPECT(copy_checked(0, 0, 0, 4, 1), "empty copy");
    EXPECT(copy_checked(40 * MiB, 0, 0, 1, 2), "one thread");
    EXPECT(copy_checked(40 * MiB, 0, 0, 0, 2), "zero threads");
    EXPECT(helpers() == 0, "threads before the first large copy with threads > 1: %d", helpers());

    // sizes about the threshold and a slot's 32 MiB, at aligned and odd offsets, on 2..8 threads
    const size_t sizes[] = {min, min + 1, min + 4095, 5 * MiB + 7, 32 * MiB, 33 * MiB + 4097};
    const size_t offsets[][2] = {{0, 0}, {1, 0}, {0, 3}, {4095, 17}, {4096, 4096}};
    for (long threads : {2L, 3L, 4L, 8L})
        for (size_t n : sizes)
            for (auto& o : offsets)
                EXPECT(copy_checked(n, o[0], o[1], threads, (unsigned)(n + threads)), "n=%zu src+%zu dst+%zu threads=%ld",
                       n, o[0], o[1], threads);
    EXPECT(helpers() == 7, "helpers after copies on up to 8 threads: %d", helpers());
    EXPECT(helpers_block_signals(), "helpers do not block the application's signals");

    // several application threads copying at once (one gets the helpers, the others copy alone)
    std::atomic<int> bad{0};
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; t++)
        callers.emplace_back([t, &bad] {
            for (int k = 0; k < 6; k++)
                if (!copy_checked(9 * (1 << 20) + 4097 * t, t, 2 * t, 4, t * 10 + k)) bad++;
        });
    for (auto& c : callers) c.join();
    EXPECT(bad == 0, "concurrent copies wrong: %d", bad.load());

    // fork, while another thread copies: the child has none of our helpers and maybe a pool
    // caught mid-copy; it copies right, with helpers of its own
    std::atomic<bool> stop{false};
    std::thread busy([&] { while (!stop) if (!copy_checked(24 * (1 << 20), 0, 0, 4, 5)) bad++; });
    for (int k = 0; k < 8; k++) {
        usleep(3000 * k);
        pid_t child = fork();
        if (child == 0) {
            alarm(30);   // a hang is a failure, not a stuck test
            const int inherited = helpers();
            const bool right = copy_checked(33 * (1 << 20) + 5, 3, 1, 4, 9) && copy_checked(8 * (1 << 20), 0, 0, 4, 8);
            _exit(inherited != 0 ? 3 : !right ? 4 : helpers() != 3 ? 5 : 0);
        }
        int status = 0;
        waitpid(child, &status, 0);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child %d: status %#x", k, status);
    }
    stop = true;
    busy.join();
    EXPECT(bad == 0, "copies beside the forks wrong: %d", bad.load());

    printf("%s\n", fails ? "FAILED" : "PASS");
    fflush(stdout);
    if (argc > 1 && !strcmp(argv[1], "exit-while-copying")) {
        // exit() while a detached thread copies through the helpers: the process ends at once
        std::thread([] { while (true) copy_checked(32 * (1 << 20), 0, 0, 4, 1); }).detach();
        usleep(20000);
        exit(fails ? 1 : 0);
    }
    return fails ? 1 : 0;   // helpers waiting: they must not hold the exit
}
"""


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    if not CXX:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("parallel_copy")
    (out / "check.cpp").write_text(CHECK_CPP)
    exe = out / "check"
    r = subprocess.run([CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread", "-I", NATIVE,
                        "-o", str(exe), str(out / "check.cpp"), os.path.join(NATIVE, "parallel_copy.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.mark.parametrize("how", ["return", "exit-while-copying"])
def test_parallel_copy(check, how):
    r = subprocess.run([str(check)] + ([how] if how != "return" else []), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "PASS", r.stdout + r.stderr
