#!/bin/sh
# Builds OUTDIR/libcuda.so.1, NVIDIA's driver with its calls reported (trace_shim.cpp):
#   sh perf/driver_trace/build.sh OUTDIR
#   REAL_LIBCUDA=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}') LD_LIBRARY_PATH=OUTDIR python3 app.py
# Run it on the GPU machine: it reads that driver's exports to forward them.
set -eu
out=$1
here=$(cd "$(dirname "$0")" && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
real=${REAL_LIBCUDA:-$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')}
mkdir -p "$out"
# One jump per export, through a pointer filled from the real driver at load.
nm -D --defined-only "$real" | awk '$2 == "T" && $3 ~ /^cu/ {sub(/@.*/, "", $3); print $3}' | sort -u |
    grep -vx 'cuGetProcAddress\|cuGetProcAddress_v2' | awk '
    { names[NR] = $1 }
    END {
        print "#include <dlfcn.h>"
        print "void* real_driver();"
        for (i = 1; i <= NR; i++) print "__attribute__((visibility(\"hidden\"))) void* fwd_" names[i] ";"
        for (i = 1; i <= NR; i++)
            printf "asm(\".text\\n.globl %s\\n.type %s,@function\\n%s:\\n jmp *fwd_%s(%%rip)\");\n", names[i], names[i], names[i], names[i]
        print "__attribute__((constructor)) static void fill() {"
        print "    void* h = real_driver();"
        for (i = 1; i <= NR; i++) print "    fwd_" names[i] " = dlsym(h, \"" names[i] "\");"
        print "}"
    }' > "$out/forwarders.cpp"
g++ -O1 -shared -fPIC -I"$CUDA_HOME/include" -o "$out/libcuda.so.1" "$here/trace_shim.cpp" "$out/forwarders.cpp" -ldl
echo "built $out/libcuda.so.1 over $real"
