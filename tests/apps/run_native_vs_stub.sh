#!/bin/sh
# GPU check (perf/device/run.sh stub runs it on the H200): every test program natively (NVIDIA's
# libcudart and driver), then through phos's native stub against a `cuda` server, and
# the two outputs compared. Exits non-zero if a program fails or the outputs differ.
#   tests/apps/run_native_vs_stub.sh [--server ADDR]
# Without --server it starts `phos server --backend cuda` on a private ipc socket.
# Through phos the programs load NVIDIA's libcudart.so.13 that phos/stub holds, on phos's
# libcuda.so.1.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PYTHON=${PYTHON:-python3}
server=""
[ "${1:-}" = "--server" ] && server=$2

. "$root/tests/apps/stub_session.sh"
sh "$here/build_apps.sh" "$work/bin"

[ -n "$server" ] || start_server cuda

native_path="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
stub_path="$root/phos/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bad=0
for app in vector_add matmul_tiled streams_events atomics symbols threads device_reset errors launch_batch device_query no_gpu driver_api \
        runtime_features graph_nodes managed_memory multi_gpu; do
    args=""
    [ "$app" = driver_api ] && args="$work/bin/driver_kernels.ptx"
    set +e
    LD_LIBRARY_PATH=$native_path "$work/bin/$app" $args > "$work/$app.native" 2>&1
    native_rc=$?
    LD_LIBRARY_PATH=$stub_path PHOS_SERVER=$server "$work/bin/$app" $args > "$work/$app.phos" 2> "$work/$app.phos.err"
    phos_rc=$?
    set -e
    if [ $native_rc -eq 0 ] && [ $phos_rc -eq 0 ] && diff -q "$work/$app.native" "$work/$app.phos" >/dev/null; then
        echo "same       $app"
    else
        bad=1
        echo "DIFFERENT  $app (native exit $native_rc, phos exit $phos_rc)"
        diff "$work/$app.native" "$work/$app.phos" | sed 's/^/    /' || true
        sed 's/^/    stderr: /' "$work/$app.phos.err"
    fi
done
exit $bad
