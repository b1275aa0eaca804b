#!/usr/bin/env bash
# The main demo on the emu backend: bash scripts/demo.sh
# Starts a phos server, runs a cuda-python program through the Python client and, when
# the native stub is built, an unmodified CUDA program through `phos run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
dir=$(mktemp -d)
export PHOS_SERVER="ipc://$dir/phos.sock"
python3 -m phos.cli server --backend emu --listen "$PHOS_SERVER" > "$dir/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
until grep -q "listening" "$dir/server.log" 2>/dev/null; do sleep 0.1; done
echo "== a cuda-python program, one import line changed, against $PHOS_SERVER"
python3 examples/saxpy.py
if [ -x phos/stub/libcudart.so.13 ] || [ -e phos/stub/libcudart.so.13 ]; then
    echo "== an unmodified CUDA program (nvcc -cudart shared) under phos run"
    nvcc -cudart shared -gencode arch=compute_90,code=compute_90 -o "$dir/vector_add" examples/vector_add.cu
    python3 -m phos.cli run --server "$PHOS_SERVER" -- "$dir/vector_add"
fi
