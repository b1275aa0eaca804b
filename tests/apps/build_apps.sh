#!/bin/sh
# Builds the test programs into OUTDIR, as the tests and run_native_vs_stub.sh use them:
#   * runtime programs with `nvcc -cudart shared` (they load the libcudart.so.13 in phos/stub),
#     embedding compute_90 PTX (what the emu backend runs) and sm_90 SASS;
#   * driver_api against libcuda.so.1, plus its kernels as PTX (driver_kernels.ptx).
#   build_apps.sh OUTDIR
# PHOS_APPS_RPATH=DIR pins the runtime programs to DIR's libcudart.so.13 by RPATH, which the
# loader searches before LD_LIBRARY_PATH: how PyTorch's wheels load NVIDIA's own runtime.
set -eu
out=$1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
mkdir -p "$out"
gencode="-gencode arch=compute_90,code=compute_90 -gencode arch=compute_90,code=sm_90"
pids=""
for src in "$here"/*.cu; do
    name=$(basename "$src" .cu)
    case $name in
    driver_api|driver_kernels) continue ;;
    esac
    $NVCC -cudart shared $gencode ${PHOS_APPS_RPATH:+-Xlinker --disable-new-dtags -Xlinker -rpath="$PHOS_APPS_RPATH"} \
        -o "$out/$name" "$src" &
    pids="$pids $!"
done
# driver_api links libcuda.so.1: NVIDIA's link stub if the toolkit has one, else phos's.
libcuda_dir="$CUDA_HOME/lib64/stubs"
[ -f "$libcuda_dir/libcuda.so" ] || libcuda_dir="$root/phos/stub"
$NVCC -o "$out/driver_api" "$here/driver_api.cu" -L"$libcuda_dir" -lcuda &
pids="$pids $!"
$NVCC -ptx -arch=compute_90 -o "$out/driver_kernels.ptx" "$here/driver_kernels.cu" &
pids="$pids $!"
status=0
for p in $pids; do wait "$p" || status=1; done
exit $status
