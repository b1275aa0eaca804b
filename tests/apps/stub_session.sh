# Sourced by tests/apps/run_native_vs_stub.sh and perf/bench_stub.sh: a scratch folder
# removed on exit, the native stub (rebuilt where the build tools are), and a local
# phos server for the run. Expects $root and $PYTHON.
work=$(mktemp -d)
server_pid=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT INT TERM

# Rebuild the stub where the build tools are; a GPU machine may only have it prebuilt.
make -s -C "$root/client_stub/native" 2>"$work/make.log" || {
    [ -f "$root/phos/stub/libcuda.so.1" ] || { cat "$work/make.log"; exit 1; }
    echo "note: using the prebuilt phos/stub (cannot rebuild here: $(tail -1 "$work/make.log"))"
}

# start_server BACKEND: a server on a private ipc socket; sets $server.
start_server() {
    server="ipc://$work/phos.sock"
    (cd "$root" && exec $PYTHON -m phos.cli server --backend "$1" --listen "$server") > "$work/server.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 600); do [ -S "$work/phos.sock" ] && break; sleep 0.1; done
    [ -S "$work/phos.sock" ] || { echo "the $1 server did not start:"; cat "$work/server.log"; exit 1; }
}
