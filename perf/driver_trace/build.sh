#!/bin/sh
# Builds OUTDIR/libcuda.so.1, a driver with its calls reported (trace_shim.cpp), over REAL:
# NVIDIA's driver (the default) or phos's stub, to set the two side by side:
#   sh perf/driver_trace/build.sh OUTDIR [REAL]
#   REAL_LIBCUDA=REAL LD_LIBRARY_PATH=OUTDIR python3 app.py 2> trace.txt
# Every export of REAL not defined in trace_shim.cpp is forwarded as it is.
set -eu
out=$1
here=$(cd "$(dirname "$0")" && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
real=${2:-$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')}
mkdir -p "$out"
defined=$(grep -o '^CUresult cu[A-Za-z_0-9]*(' "$here/trace_shim.cpp" | sed 's/^CUresult //; s/($//' | sort -u | tr '\n' '|')
# One jump per export, through a pointer filled from REAL at load.
nm -D --defined-only "$real" | awk '$2 == "T" && $3 ~ /^cu/ {sub(/@.*/, "", $3); print $3}' | sort -u |
    grep -vxE "cuGetProcAddress|cuGetProcAddress_v2|${defined%|}" | awk '
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
