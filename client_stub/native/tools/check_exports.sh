#!/bin/sh
# Fails unless a built stub library exports only CUDA entry points and needs only
# libraries every Linux machine has (glibc's, libgcc_s): what makes it safe to load into
# any program, and loadable on a machine with nothing installed.
#   check_exports.sh LIBRARY
set -eu
lib=$1
bad=$(nm -D --defined-only "$lib" | awk 'NF >= 3 && $2 != "A" {print $3}' | sed 's/@.*//' | grep -Ev '^(cu|cuda|__cuda)' || true)
if [ -n "$bad" ]; then
    echo "check_exports: $lib exports non-CUDA symbols:" >&2
    echo "$bad" | head -20 >&2
    exit 1
fi
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' |
         grep -Ev '^(libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|ld-linux-x86-64\.so\.2|libcuda\.so\.1)$' || true)
if [ -n "$needed" ]; then
    echo "check_exports: $lib needs libraries a bare machine may lack: $needed" >&2
    exit 1
fi
