#!/usr/bin/env bash
# Run chosen tests on the device with a time limit, tracebacks of a hang, and every server's log:
#   run(command="bash perf/device/diagnose.sh 280 tests/e2e/test_x.py::test_y ...", carry=[".whl", "phos/stub"])
set -uo pipefail
OUT=${OUT:-/tmp/phos-device-out}
limit=$1; shift
bash perf/device/run.sh none >/dev/null || exit 1
export PYTHONPATH=/tmp/phos-site:/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PHOS_STUB_DIR=$PWD/phos/stub
rm -rf /tmp/phos-diag
timeout -s INT "$limit" python3 -m pytest -v -p no:cacheprovider --backend cuda --basetemp=/tmp/phos-diag \
    -o faulthandler_timeout=$((limit * 2 / 3)) "$@" 2>&1 | tee "$OUT/diagnose.txt" | tail -60
find /tmp/phos-diag -name server.log | while read -r f; do mkdir -p "$OUT/logs/$(dirname "${f#/tmp/phos-diag/}")"; tail -c 20000 "$f" > "$OUT/logs/${f#/tmp/phos-diag/}"; done
