#!/usr/bin/env bash
# Install what phos needs on a fresh Debian 12 machine (as root), then build the native stub.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in libzmq3-dev libcapnp-dev capnproto pkg-config make g++ procps; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "phos setup: installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# phos's dependencies include nvidia-cuda-runtime: the stub's build copies its libcudart.so.13.
python3 -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Running pip as the 'root'" || true

# The PTX tests compile CUDA C with nvcc; install NVIDIA's nvcc wheel where it is missing.
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "phos setup: nvcc not found, installing it from NVIDIA's wheels"
    python3 -m pip install -q --disable-pip-version-check "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*"
    root=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")/nvidia
    ln -sf "$(find "$root" -path '*/bin/nvcc' | head -1)" /usr/local/bin/nvcc
fi

# CRIU 4, for whole-process checkpoints (phos checkpoint --pid)
bash scripts/setup_criu.sh

if [ -f client_stub/native/Makefile ]; then
    make -s -C client_stub/native
fi
