#!/usr/bin/env bash
# Everything phos does on the H200, in one call: install, GPU tests, benchmarks.
#
#   run(command="bash perf/device/run.sh all", carry=[".whl", "phos/stub"])
#
# The device machine has CUDA 13, cuda-python and PyTorch but no pyzmq, pycapnp or
# zstandard and no package manager: carry them as wheels in .whl/ (see docs/device.md
# for the download command) and the native stub built here in phos/stub/.
# Steps: core (cuda-backend tests), stub (tests/apps native vs stub), stub-ab (perf/bench_stub.sh before and after a change: carry .before, made by perf/device/pack_before.sh), process (whole processes with
# CRIU: carry .criu, made by perf/device/pack_criu.sh), snap (snapshot tests and
# perf/bench_snapshot.py; snap-bench: the benchmark alone), probe (perf/probe_driver_stalls.py),
# probe-decode (perf/probe_decode.py: an LLM's token natively and through phos, and the driver calls it makes),
# kernels (perf/probe_fingerprint_kernels.py: the cut's hash pass written several ways; needs nvcc),
# arena (perf/probe_host_arena.py: can images live in pinned shared memory?),
# interference (perf/probe_copy_interference.py: does copying slow the application's kernels?),
# handoff (perf/bench_image_ops.py, perf/bench_fingerprint.py, perf/bench_handoff.py; handoff-bench: the last alone),
# bench (the other perf/* benchmarks), pool (perf/bench_pool.py on Ray; needs .ray/, see docs/device.md),
# probe-freeze (perf/probe_freeze_alloc.py: what the cut's device copy costs to allocate),
# tcp-rounds (perf/bench_tcp_rounds.py: a handoff's chunks over TCP against the bare connection, a sweep of connections),
# locust (perf/locustfile.py, 5 minutes),
# torch (perf/torch_ladder.py natively, then through phos's libcuda.so.1 under NVIDIA's own runtime;
# PHOS_TORCH_STEPS picks steps, PHOS_TORCH_TRAIN_STEPS the training steps; then perf/torch_recovery.py,
# alone as torch-recovery, PHOS_TORCH_MODES its runs), bench-torch (perf/bench_torch.py, also in torch),
# plots (perf/plots.py: PNGs into $OUT/plots of the JSON that this call's snap/snap-bench, handoff/handoff-bench
# and bench steps wrote into $OUT; name it after them, as $OUT starts empty each call:
# `run.sh snap-bench handoff-bench bench plots`; what is missing is skipped).
# The benchmarks run each size 3 times (PHOS_BENCH_REPEAT, PHOS_HANDOFF_REPEAT) and print least / median / most.
set -uo pipefail
OUT=${OUT:-/tmp/phos-device-out}
mkdir -p "$OUT"
steps=${*:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/phos-site   # a warm machine keeps the last copy; pip --target would not replace it
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/phos-site . >/dev/null || exit 1
# PYTHONSAFEPATH: the checkout's own phos/ folder must not shadow the installed package
export PYTHONPATH=/tmp/phos-site:/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PHOS_STUB_DIR=$PWD/phos/stub
status=0
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
step() {   # step NAME COMMAND...: run it, log it, remember a failure
    local name=$1; shift
    echo "=== $name: $*" | tee -a "$OUT/log.txt"
    "$@" 2>&1 | tee -a "$OUT/log.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc" | tee -a "$OUT/log.txt"
    [ "$rc" = 0 ] || status=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/log.txt"
ldconfig -p | grep -c libsodium | sed 's/^/libsodium libraries installed: /' | tee -a "$OUT/log.txt"
# CRIU for whole-process checkpoints travels in .criu/ (perf/device/pack_criu.sh)
[ -x .criu/criu ] && export PHOS_CRIU=$PWD/.criu/criu
# core, stub and snap run the test files marked `gpu` (pyproject): pytest -m 'gpu and not fuzz'
# --backend cuda selects the same tests; a file new to these lists gets that mark
if want core; then
    step core-tests python3 -m pytest -q -p no:cacheprovider --backend cuda -m "not fuzz" \
        tests/e2e/test_client_e2e.py tests/e2e/test_kernels_e2e.py tests/e2e/test_bad_input.py tests/e2e/test_server_lifecycle.py \
        tests/native/test_launch_batch.py tests/e2e/test_isolation.py tests/e2e/test_fuzz.py tests/e2e/test_client_death.py
fi
if want stub; then
    step stub-tests python3 -m pytest -q -p no:cacheprovider --backend cuda tests/native/test_stub.py tests/native/test_stub_reattach.py tests/native/test_vmm.py tests/native/test_nvml.py \
        tests/native/test_module_digest_loads.py \
        tests/native/test_stub_recovery.py
    step stub-apps sh tests/apps/run_native_vs_stub.sh
fi
if want snap; then
    # PHOS_SNAP_TESTS: the test files to run (default: all three)
    step snapshot-tests python3 -m pytest -q -p no:cacheprovider --backend cuda \
        ${PHOS_SNAP_TESTS:-tests/e2e/test_snapshot_engine.py tests/e2e/test_handoff.py tests/e2e/test_recovery.py}
fi
if want snap || want snap-bench; then
    # PHOS_BENCH_SIZES= (empty) runs the tests alone; PHOS_BENCH_REPEAT: runs a size, the driver's and phos's;
    # PHOS_BENCH_ARGS: more arguments (--no-driver --no-disk: phos's host-memory rows alone)
    [ -z "${PHOS_BENCH_SIZES-1,8,32}" ] || step bench-snapshot python3 perf/bench_snapshot.py --backend cuda \
        --sizes "${PHOS_BENCH_SIZES-1,8,32}" --repeat "${PHOS_BENCH_REPEAT:-3}" --json "$OUT/bench_snapshot.json" \
        ${PHOS_BENCH_ARGS:-}
fi
if want stub-ab; then
    # the stub's launch and synchronize figures before and after a change, on one machine, turn by turn:
    # .before/ (perf/device/pack_before.sh REV, carried) against this tree; PHOS_AB_RUNS turns (3)
    [ -d .before ] || { echo "stub-ab: no .before/ (perf/device/pack_before.sh REV, then carry it)"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/phos-before-site \
        ./.before >/dev/null || exit 1
    for i in $(seq "${PHOS_AB_RUNS:-3}"); do
        step "stub-before-$i" env -C .before PYTHONPATH=/tmp/phos-before-site:/tmp/site PHOS_STUB_DIR="$PWD/.before/phos/stub" \
            sh perf/bench_stub.sh --repeat 1 --json "$OUT/stub_before.$i.json"
        step "stub-after-$i" sh perf/bench_stub.sh --repeat 1 --json "$OUT/stub_after.$i.json"
    done
fi
if want process || want process-bench; then
    # whole processes (phos/process.py): CRIU here first, then the LLM benchmark (PHOS_PROCESS_LAYERS: its depth;
    # the servers' logs into $OUT/process-logs), PyTorch training through a checkpoint and restore, and the tests
    # on the cuda backend; process-bench: CRIU's check and the benchmark alone
    step criu-check "${PHOS_CRIU:-criu}" check
    step bench-process python3 perf/bench_process.py --layers "${PHOS_PROCESS_LAYERS:-32}" --json "$OUT/bench_process.json" \
        --logs "$OUT/process-logs"
fi
if want process; then
    step torch-process python3 perf/torch_process.py --backend cuda --steps 200 --at 100 --json "$OUT/torch_process.json"
    step process-tests python3 -m pytest -q -p no:cacheprovider --backend cuda tests/e2e/test_process.py
    # the tests' server logs (the servers in namespaces of their own print nothing else)
    find /tmp/pytest-of-root -name server.log 2>/dev/null | tar -czf "$OUT/process-test-logs.tar.gz" -T - 2>/dev/null
fi
if want probe-decode; then
    step probe-decode python3 perf/probe_decode.py --layers "${PHOS_DECODE_LAYERS:-4}" --json "$OUT/probe_decode.json"
fi
if want probe; then
    step probe-driver-stalls python3 perf/probe_driver_stalls.py
fi
if want kernels; then
    step probe-fingerprint-kernels python3 perf/probe_fingerprint_kernels.py --sizes "${PHOS_KERNELS_GIB:-8,32}"
fi
if want interference; then
    step probe-copy-interference python3 perf/probe_copy_interference.py --gib "${PHOS_INTERFERENCE_GIB:-8}"
fi
if want arena; then
    step probe-host-arena python3 perf/probe_host_arena.py --gib "${PHOS_ARENA_GIB:-16}" --only "${PHOS_ARENA_ONLY:-}"
fi
if want handoff; then
    step bench-image-ops python3 perf/bench_image_ops.py     # the per-chunk Python of a frozen round, on this host's CPU
    step bench-fingerprint python3 perf/bench_fingerprint.py --sizes 1,8
fi
if want handoff || want handoff-bench; then
    # PHOS_HANDOFF_CHUNK_KIB: the rounds' chunk size (default the server's, 2 MiB); PHOS_HANDOFF_REPEAT: runs a size;
    # PHOS_HANDOFF_VIA: how the rounds travel (host store, shm, or tcp: servers sharing nothing but TCP)
    step bench-handoff python3 perf/bench_handoff.py --backend cuda --sizes ${PHOS_HANDOFF_SIZES:-1,8} \
        --chunk-kib "${PHOS_HANDOFF_CHUNK_KIB:-0}" --repeat "${PHOS_HANDOFF_REPEAT:-3}" --via "${PHOS_HANDOFF_VIA:-host store}" \
        --json "$OUT/bench_handoff.json"
fi
if want locust; then
    # perf/locustfile.py: 64 users for 5 minutes against one cuda server; needs locust and its
    # dependencies in .whl/ (README, "On a GPU"). The table: $OUT/locust-summary.md; it fails on a leak.
    rm -rf /tmp/phos-locust && mkdir -p /tmp/phos-locust
    # PHOS_LOCUST_POOL: pre-started workers (--pool); 64 made every user's calls slower (RESULTS.md)
    # the 64 users are one local user: one client to the per-client limit
    PHOS_MAX_CONTEXTS_PER_CLIENT=0 python3 -m phos.cli server --backend cuda --listen ipc:///tmp/phos-locust/phos.sock --pool "${PHOS_LOCUST_POOL:-1}" \
        > "$OUT/locust-server.log" 2>&1 &
    locust_server=$!
    for _ in $(seq 300); do grep -q "listening on" "$OUT/locust-server.log" && break; sleep 0.2; done
    python3 - <<'PY'    # until the pool is full: users must not race its start-up
import os
import time
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
deadline = time.monotonic() + 180
want = int(os.environ.get("PHOS_LOCUST_POOL", "1"))
while stub("ipc:///tmp/phos-locust/phos.sock").Stats(pb.StatsRequest()).standby_workers < want and time.monotonic() < deadline:
    time.sleep(1)
PY
    # run from /tmp: locust puts its working directory on sys.path, where the checkout's phos/
    # folder would shadow the installed package
    step locust env -C /tmp PHOS_SERVER=ipc:///tmp/phos-locust/phos.sock PHOS_LOCUST_SUMMARY="$OUT/locust-summary.md" \
        python3 -m locust -f "$PWD/perf/locustfile.py" --headless -u 64 -r 4 -t "${PHOS_LOCUST_TIME:-5m}" --stop-timeout 30 \
        --csv "$OUT/locust" --only-summary
    kill "$locust_server"; wait "$locust_server"
fi
if want torch; then
    # what the real driver exports and which of phos's export tables it has
    nm -D --defined-only "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" > "$OUT/libcuda-exports.txt" 2>&1
    gcc -I"${CUDA_HOME:-/usr/local/cuda}/include" perf/probe_export_tables.c -o /tmp/probe_export_tables -ldl &&
        step probe-export-tables /tmp/probe_export_tables
    rm -rf /tmp/phos-torch && mkdir -p /tmp/phos-torch
    python3 -m phos.cli server --backend cuda --listen ipc:///tmp/phos-torch/phos.sock > "$OUT/torch-server.log" 2>&1 &
    torch_server=$!
    for _ in $(seq 300); do grep -q "listening on" "$OUT/torch-server.log" && break; sleep 0.2; done
    ladder="python3 perf/torch_ladder.py --steps ${PHOS_TORCH_STEPS:-tensors,matmul,conv,autocast,cnn,transformer,graph,compile,expandable} --train-steps ${PHOS_TORCH_TRAIN_STEPS:-200}"
    step torch-native $ladder --json "$OUT/torch-native.json"
    step torch-phos env LD_LIBRARY_PATH="$PWD/phos/stub" PHOS_SERVER=ipc:///tmp/phos-torch/phos.sock PHOS_VERBOSE=1 \
        timeout "${PHOS_TORCH_TIMEOUT:-300}" $ladder --json "$OUT/torch-phos.json"
    step torch-compare python3 perf/torch_ladder.py --compare "$OUT/torch-native.json" "$OUT/torch-phos.json"
    kill "$torch_server"; wait "$torch_server"
fi
if want torch || want torch-recovery; then
    # the CNN's training through a SIGKILLed server (recovery images, a standby) and through a
    # live handoff, each at step PHOS_TORCH_AT of PHOS_TORCH_TRAIN_STEPS: the loss curve must equal native
    step torch-recovery env PHOS_STUB_DIR="$PWD/phos/stub" python3 perf/torch_recovery.py --steps "${PHOS_TORCH_TRAIN_STEPS:-200}" \
        --at "${PHOS_TORCH_AT:-100}" --modes "${PHOS_TORCH_MODES:-recover,handoff}" --json "$OUT/torch-recovery.json" --logs "$OUT"
fi
if want torch || want bench-torch; then
    # GPT-2-small training and inference, a launch-bound MLP, a 4 GiB load: native and through
    # phos; then a checkpoint of the training context while it trains (PHOS_BENCH_TORCH: workloads)
    step bench-torch python3 perf/bench_torch.py --only "${PHOS_BENCH_TORCH:-gpt2_train,gpt2_infer,mlp_train,load_4gib,checkpoint}" \
        --json "$OUT/bench-torch.json"
fi
if want pool; then
    # perf/bench_pool.py on the GPU: two pool servers on Ray, each with its own /dev/shm and /tmp.
    # Ray comes as .ray/ray-slim.tar.xz (docs/device.md: its wheel, 79 MB, passes what a call may carry).
    # Run from /tmp: Ray's workers put the driver's working directory on sys.path, where the
    # checkout's phos/ folder would shadow the installed package
    rm -rf /tmp/ray-site && mkdir -p /tmp/ray-site && tar -xJf .ray/ray-slim.tar.xz -C /tmp/ray-site &&
        step bench-pool env -C /tmp PYTHONPATH="/tmp/ray-site:$PYTHONPATH" timeout "${PHOS_POOL_TIMEOUT:-420}" python3 "$PWD/perf/bench_pool.py" \
            --backend cuda --nodes 2 --private-mounts --contexts 64 --server-pool 40 --checkpoint-every 600 \
            --sizes "${PHOS_POOL_SIZES:-1,8}" --unit GiB --json "$OUT/bench_pool.json" ${PHOS_POOL_ARGS:-}
fi
if want tcp-rounds; then
    step bench-tcp-rounds python3 perf/bench_tcp_rounds.py --mib "${PHOS_TCP_ROUNDS_MIB:-2048}" \
        --connections "${PHOS_TCP_ROUNDS_CONNECTIONS:-1,2,4,8}"
fi
if want probe-freeze; then
    step probe-freeze-alloc python3 perf/probe_freeze_alloc.py --gib 1,9.65
fi
if want bench; then
    step transport-floor python3 perf/transport_floor.py
    step bench-rpc python3 perf/bench_rpc.py --backend cuda --json "$OUT/bench_rpc.json"
    step bench-launch-worker python3 perf/bench_launch_decode.py --backend cuda
    step bench-stub sh perf/bench_stub.sh --json "$OUT/bench_stub.json"     # its copy sweep: plots' bandwidth
    step bench-tcp-copies python3 perf/bench_tcp_copies.py --backend cuda --sizes 1,64,256
fi
if want plots; then
    # matplotlib is on this machine already (a perf-only need, not in .whl/)
    step plots python3 perf/plots.py --snapshot "$OUT/bench_snapshot.json" --handoff "$OUT/bench_handoff.json" \
        --copies "$OUT/bench_stub.json" --out "$OUT/plots"
fi
exit $status
