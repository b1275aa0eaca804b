#!/usr/bin/env bash
# Packs a "before" tree for the GPU machine, so that one call can time a change against what it
# changes: the source of REV (a commit) with its own native stub built, into .before/ (carry it;
# run.sh's stub-ab step runs perf/bench_stub.sh from both trees, turn by turn).
#   bash perf/device/pack_before.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: pack_before.sh REV}
rm -rf .before && mkdir .before
git archive "$rev" | tar -x -C .before
make -s -C .before/client_stub/native
rm -rf .before/client_stub/native/build      # the stub is in .before/phos/stub; the objects need not travel
echo "$(git rev-parse --short "$rev")" > .before/REV
du -sh .before
