@0x945b8f6e2c5d67c5;
# phos data plane. One ZeroMQ message = one Request frame (this schema) followed by
# zero or more raw payload frames. Bulk bytes never travel inside a capnp message:
# a call names its payload by index (1 = the first frame after the Request).
#
# A Request carries a batch of calls. The receiver answers a Request only when the
# sender asks (`wantReply`, set when its last call is synchronous); that Reply acknowledges every call up to
# `ackSeq` and carries the results of all calls that produced values since the
# previous Reply. Errors of asynchronous calls are reported by the next Reply.
#
# Session flow
#  1. A DEALER connects to the server's front end (PHOS_SERVER). Its first call is
#     `hello`; a version mismatch is refused with CUDA_ERROR_NOT_SUPPORTED and a message.
#     Device calls (driverGetVersion, device*) are answered by the front end.
#  2. `ctxCreate` on the front end starts a context worker; its Result holds
#     u64s=[ctx id], text=the worker's endpoint, data=the session token.
#  3. The client opens a second DEALER to that endpoint. Its first call is
#     `attach{ctx, token}`; every context call then goes there. ctxDestroy ends it.
#  Stream id 0 is the default stream (CU_STREAM_LEGACY=1 and CU_STREAM_PER_THREAD=2
#  mean it too). Every other id is one the worker handed out.
#
# Results. A Reply holds one Result for the call that asked for it (the last) and one
# for each earlier asynchronous call that returned bytes (memcpyDtoH on a stream).
# If an asynchronous call failed since the previous Reply, the last call is not run:
# its Result carries the first such failure, the message naming the failed call.
# Sticky errors (illegal address, launch failure, trap) fail every later call.
#
# The shared staging area (same host only; see Attach). The client creates a file,
# offers it in attach, and unlinks it once the worker answered. Its layout, little-endian, is
# the staging* constants below (the one definition: the native stub reads them from the
# generated header, Python from this file through pycapnp, schema/wire.py):
#   cookie                  random bytes the worker compares with Attach.shmCookie
#   workerAwake             UInt64: 1 while the worker watches the mailbox, else 0
#   clientAsleep            UInt64: the seq of the mailbox request whose client stopped
#                           spinning for the reply and sleeps in poll on the socket
#   request box             UInt64 seq, UInt64 len, then len bytes of a Request frame
#   reply box               the same for a Reply frame, right after the request box
#   bulk slots, to the end  memcpyHtoD/DtoH with viaShm name byte offsets into the file
# The mailbox skips the socket for synchronous calls. A client may put a Request there
# when it wants a reply, has no payload frames and no memcpyDtoH answered by frames: it
# writes the bytes, then len, then seq (1, 2, 3... per connection), and if workerAwake
# is 0 it sends a Request with doorbell=true and no calls over the socket. The worker
# first runs every call sent earlier over the socket (up to the box's first seq), then
# answers in the reply box (bytes, len, then seq = the request box's seq), or over the
# socket if the Reply has payload frames or exceeds the box, if a doorbell woke the
# worker for it (its client is likely asleep in poll too), or if clientAsleep names it:
# a Reply in the box wakes nobody. The client watches both. A client going to sleep writes
# clientAsleep, then looks at the reply box once more; a worker, the other way round.
# The box holds one request: a client uses it only for a call it waits for at once, and
# sends nothing over the socket until that call is answered (else the worker could run
# a later socket message before the earlier mailbox request).
#
# Pinned host memory (same host only: a client whose worker mapped its staging area). A client
# may allocate pinned host memory (cuMemHostAlloc) as a shared-memory file of its own, made as
# the staging file is: a memfd named "phos", sealed against shrinking and growing, which the
# client names /proc/<its pid>/fd/<fd>. Its first pinnedHeaderBytes are a header that starts
# with a random cookie of stagingCookieBytes; the application's bytes follow, and the
# application never maps the header, so nothing it does or is fed can read or forge the
# cookie. The client keeps the descriptor open while the memory is allocated, so that any
# worker of the client's (one re-attached to included) can map it; nothing outlives the client.
# The client announces it with hostMap{id, path, cookie, size} (size: the application's bytes;
# id: the client's, never 0). The worker maps it with the staging file's checks (session.py,
# open_client_file: a memfd "phos" of the asking process, whose pid the connection's
# SO_PEERCRED gives, owned by its user, sealed against shrinking, so that it can never be cut
# short under the worker's mapping, of the size announced or more, whose header starts with
# the cookie), up to the bytes its server allows a worker
# (PHOS_PINNED_HOST_BYTES), and pins it; Result u64s = [1] if it did, else [0] and text saying
# why: copies then travel as for any other memory.
# A copy whose host side lies in a mapped range is a memcpyPinned naming (range, offset, size):
# no bytes travel, no staging slot is used; the worker copies between its mapping and the
# device on the call's stream. With `wait` (a synchronous copy) it answers once the bytes are
# there; without, the copy is queued and done by the stream's next synchronization, and a
# failure is an asynchronous call's. hostUnmap{id} waits for the device's work, then unmaps.
# Memory the device reads and writes in place (cuMemAllocManaged, cuMemHostAlloc and cuMemHostRegister with DEVICEMAP):
# hostMap with `address`, the client's own address of the range's bytes, asks the worker to map
# them at that same address (so that pointers stored in data structures mean the same in both
# processes) and make them the device's to address: the cuda backend registers them with
# DEVICEMAP and requires the device pointer to be that address; emu's kernels load and store
# them. u64s = [1] if so, else [0] and text saying why (the address is taken in the worker, the
# device maps it elsewhere), and the client's call fails. Kernels then read and write the
# application's pages directly; the application sees their writes after a synchronising call.
# hostMap and hostUnmap take no place in the call stream: each travels alone with seq 0, like a
# re-attach's attach, and is never resent. Mappings are the connection's, not the context's:
# images hold none; a client that re-attached announces its ranges again as it copies, and its
# log resends a memcpyPinned as a memcpyHtoD with its bytes, or a memcpyDtoH answered in a frame.
#
# Launch batches. Launches are the hot path: a worker pays about a microsecond per capnp
# field it reads, so clients send launches as `launchBatch`, consecutive launches of one
# Request packed into one Data blob (a lone launch is a batch of one; `launch` stays for
# other clients). The blob is a sequence of records, little-endian, with no padding:
#   UInt64 function id
#   40 bytes, as Launch.config: grid x, y, z, block x, y, z, shared bytes, options (UInt32s), stream (UInt64)
#   UInt32 n, the length of the parameters
#   n bytes of parameters, packed as Launch.params
# Sequence numbers: each launch takes one seq, as if sent alone, so that a batch of k
# launches holds seqs s-k+1 .. s, where s is the batch's Call.seq (the seq of its LAST
# launch). A Reply acknowledges a batch as a whole (ackSeq >= s). A Request that begins
# with a batch begins at seq s-k+1: that is the "first seq" the mailbox's worker waits for.
# The worker runs the records in order, exactly as k `launch` calls: a launch that fails
# (bad handle, shape or parameter size) is an asynchronous error reported by the next
# synchronizing call, naming the kernel, and the launches after it still run; a sticky
# error stops the rest. A malformed blob (no records, a record cut short, a length
# running past the end) runs no launch and fails with CUDA_ERROR_INVALID_VALUE.

# Snapshots (snapshot/engine.py). Each worker also binds a control socket, known only to
# the front end, that speaks the control plane (ControlRequest and ControlReply in
# schema/admin.proto), not the application's calls. Its first request is attach{ctx, token = the
# control token}; then the front end sends tenant, checkpoint, restore, ctx_stats, pace, thaw and retire_to.
# A restored context keeps its ctx id, handles and addresses; its client finds the new worker
# by sending reattach{ctx, token} to the front end, attaches with its session token (attach's
# u64s[2] is the worker's last executed seq, the image's cut), and resends its unacknowledged
# calls after that seq.
#
# Recovery (gpu_server/worker/recovery.py). A server started with --recovery-dir takes periodic
# incremental images of every context (--checkpoint-every SECONDS, --checkpoint-calls N)
# so that a context whose worker or server died can be restored, there or on the server's
# --standby. attach's Result then has u64s[3] = 1 and text = the standby's address ("" for
# none). Such a client keeps every call after the latest image's cut (Reply.durableSeq),
# not only those after ackSeq, with the host bytes of its copies (never borrowed memory,
# never a staging slot), and bounds that log: when full, it calls logFull until durableSeq
# lets it shrink. When its worker goes away it asks its server, then the standby, with
# reattach{ctx, token}; a front end that does not hold the context restores it from the
# latest image in its recovery directory whose session token matches. The client resends
# its log after the cut, and drops the Results of calls that had been answered already.
# A front end that handed the context off answers reattach with the target's worker and the
# target server's standby (Result data): a client that had not re-attached at the target
# before it died still learns whom to ask.

const protocolVersion :UInt32 = 4;   # 4: hostMap's address (memory the device reads and writes in place)

# Where a client looks for the server when PHOS_SERVER is unset, and where `phos server`
# listens by default: ipc://DIR/defaultSocket in the user's own socket directory DIR, which
# is /run/phos for root, else $XDG_RUNTIME_DIR/phos, else /tmp/phos-UID (phos/base/settings.py
# socket_directory, the stub's settings.cpp); a directory another user owns is refused.
const defaultSocket :Text = "phos.sock";
# A Request holding more calls than this is refused whole, before any of them runs: one
# message must not hold a worker, or the front end every client shares, for long. Clients
# batch fewer (PHOS_BATCH_CALLS is clamped to it).
const maxRequestCalls :UInt32 = 4096;

# The shared staging area's layout (header comment), in bytes. Constants hold no arithmetic:
# stagingSlotsOffset = stagingBoxOffset + 2 * stagingBoxSize (tests/unit/test_settings.py checks).
const stagingCookieBytes :UInt64 = 16;         # [0, 16) the cookie
const stagingAwakeOffset :UInt64 = 16;         # [16, 24) workerAwake
const stagingAsleepOffset :UInt64 = 24;        # [24, 32) clientAsleep
const stagingBoxOffset :UInt64 = 4096;         # the request box; the reply box follows
const stagingBoxSize :UInt64 = 65536;          # each box: UInt64 seq, UInt64 len, then a frame
const stagingSlotsOffset :UInt64 = 135168;     # the bulk slots; a worker maps no smaller file
const stagingSlotSize :UInt64 = 33554432;      # clients use two slots of 32 MiB, in turn
const stagingMinCopy :UInt64 = 262144;         # clients send smaller copies in frames
# A pinned file's header ("Pinned host memory"): the cookie, then zeros; the application's
# bytes start after it, on a page boundary whatever the page size.
const pinnedHeaderBytes :UInt64 = 65536;

struct Request {
  version @0 :UInt32;          # protocolVersion of the sender; checked on every frame
  calls @1 :List(Call);
  wantReply @2 :Bool;          # set when the last call is synchronous: the sender waits
  doorbell @3 :Bool;           # no calls: a request waits in the shared mailbox (below)
}

struct Reply {
  ackSeq @0 :UInt64;           # every call with seq <= ackSeq has been executed
  results @1 :List(Result);
  output @2 :Text;             # device-side printf output since the previous Reply
  durableSeq @3 :UInt64;       # recovery images on: every call with seq <= this is in the latest
                               # committed image (0: no news since the last Reply said it)
  moved @4 :Moved;             # handed off: the context lives at moved.endpoint now (sent by the
                               # old worker as it retires, with no results): attach there and
                               # resend the calls after its cut, without asking a front end
  movingTo @5 :Moved;          # a handoff is about to freeze the context; it will move there:
                               # connect ahead (the handshake, slow with CURVE over TCP, is then
                               # done by the moment it moves), and attach only once it has moved
}

struct Moved {
  endpoint @0 :Text;           # the worker that holds the context now
  standby @1 :Text;            # the standby of the server it went to (as reattach's Result data)
  serverKey @2 :Text;          # the CURVE public key (z85) of the server it went to ("" none): a
                               # client with CURVE keys authenticates that worker by it
}

struct Result {
  seq @0 :UInt64;
  status @1 :UInt32;           # a CUresult value
  message @2 :Text;            # why it failed, for people
  u64s @3 :List(UInt64);       # scalar results, in the order of the driver API's outputs
  f64 @4 :Float64;             # eventElapsedTime
  text @5 :Text;               # device name, worker endpoint
  data @6 :Data;               # small binary results: UUID, session token
  payload @7 :UInt32;          # index of a payload frame holding bulk bytes (0: none)
  params @8 :List(ParamInfo);  # moduleGetFunction: the kernel's parameter layout
}

struct ParamInfo {
  offset @0 :UInt32;
  size @1 :UInt32;
}


struct Call {
  seq @0 :UInt64;              # increasing per session; replay and acks use it
  union {
    # handshake and sessions (front end)
    hello @1 :Hello;
    ctxCreate @2 :CtxCreate;
    attach @3 :Attach;         # first call on a worker connection
    # device (front end)
    driverGetVersion @4 :Void;
    deviceGetCount @5 :Void;
    deviceGetName @6 :Device;
    deviceGetUuid @7 :Device;
    deviceTotalMem @8 :Device;
    deviceGetAttribute @9 :DeviceAttribute;
    deviceComputeCapability @10 :Device;
    # context (worker)
    ctxDestroy @11 :Void;
    ctxSynchronize @12 :Void;
    # memory
    memAlloc @13 :MemAlloc;
    memFree @14 :Pointer;
    memGetInfo @15 :Void;
    memGetAddressRange @16 :Pointer;
    memcpyHtoD @17 :MemcpyHtoD;
    memcpyDtoH @18 :MemcpyDtoH;
    memcpyDtoD @19 :MemcpyDtoD;
    memset @20 :Memset;
    # modules and functions
    moduleLoad @21 :ModuleLoad;
    moduleUnload @22 :Handle;
    moduleGetFunction @23 :ModuleSymbol;
    moduleGetGlobal @24 :ModuleSymbol;
    launch @25 :Launch;
    # streams
    streamCreate @26 :StreamCreate;
    streamDestroy @27 :Handle;
    streamSynchronize @28 :Handle;
    streamQuery @29 :Handle;
    streamWaitEvent @30 :StreamWaitEvent;
    # events
    eventCreate @31 :Flags;
    eventRecord @32 :EventRecord;
    eventSynchronize @33 :Handle;
    eventQuery @34 :Handle;
    eventElapsedTime @35 :EventPair;
    eventDestroy @36 :Handle;
    launchBatch @37 :Data;     # launches packed as records: see "Launch batches" above
    # recovery: a client's calls to a front end (reattach) and to its worker (logFull)
    reattach @38 :Attach;      # where does context `ctx` live now? Result text: its worker endpoint;
                             # data, when it was handed off: the standby of the server it went to
    logFull @39 :Void;         # the client's recovery log is full: take an image now. u64s: [durable
                               # seq], or [0] without recovery images (ackSeq is what counts then)
    tensorMapEncode @40 :TensorMapEncode;   # Result data: the 128-byte CUtensorMap
    funcOccupancy @41 :FuncOccupancy;       # Result u64s: the answer (see FuncOccupancy)
    funcSetAttribute @42 :FuncAttribute;    # cuFuncSetAttribute: kept with the function, in images too
    ctxLimit @43 :CtxLimit;                 # cuCtxGetLimit / SetLimit. Result u64s: [the limit's value]
    memReserve @44 :MemReserve;             # Result u64s: [base]; kept in images
    memUnreserve @45 :Pointer;              # cuMemAddressFree: every mapping in it must be gone
    # pinned host memory ("Pinned host memory"): hostMap and hostUnmap travel alone, with seq 0
    hostMap @46 :HostMap;                   # Result u64s: [1] mapped, [0] not (text: why)
    hostUnmap @47 :Handle;                  # id: hostMap's; after the device's work
    memcpyPinned @48 :MemcpyPinned;         # a copy between the device and a mapped pinned range
    deviceP2PAttribute @49 :DeviceP2PAttribute;   # (front end) Result u64s: [the attribute's value]
  }
}

# A CUlimit of the context, read or (set) changed: what was set is kept in images too.
struct CtxLimit { limit @0 :Int32; value @1 :UInt64; set @2 :Bool; }

struct FuncAttribute { function @0 :UInt64; attribute @1 :Int32; value @2 :Int32; }

# The cuOccupancy* calls, answered by the server's driver: libraries size their grids by
# them, so an estimate could change how they split work and so their results.
#   maxActiveBlocks        a: block size, b: dynamic shared bytes, flags -> [blocks per SM]
#   availableDynamicShared a: blocks per SM, b: block size -> [bytes]
#   maxPotentialBlockSize  a: dynamic shared bytes, b: block size limit, flags -> [min grid, block size]
#   maxActiveClusters      a: block x | y << 21 | z << 42, b: dynamic shared bytes, grid: the
#                          launch's grid, packed as a; flags: the cluster as Launch.config's
#                          options -> [clusters]
struct FuncOccupancy {
  function @0 :UInt64;
  query @1 :Query;
  a @2 :UInt64;
  b @3 :UInt64;
  flags @4 :UInt32;
  grid @5 :UInt64;
  enum Query { maxActiveBlocks @0; availableDynamicShared @1; maxPotentialBlockSize @2; maxActiveClusters @3; }
}

# cuTensorMapEncodeTiled / Im2col: the driver encodes a TMA descriptor on the host, in a
# format it does not publish, so the server's driver does it. `args` is one little-endian
# record, rank-5 arrays whatever the rank (schema/wire.py, TENSOR_MAP_TILED and _IM2COL):
#   UInt32 dataType, rank; UInt64 globalAddress; UInt64 globalDim[5], globalStrides[4];
#   tiled: UInt32 boxDim[5]; im2col: Int32 lowerCorner[3], upperCorner[3], UInt32
#   channelsPerPixel, pixelsPerColumn; then UInt32 elementStrides[5], interleave, swizzle,
#   l2Promotion, oobFill.
struct TensorMapEncode {
  im2col @0 :Bool;
  args @1 :Data;
}

struct Hello {
  version @0 :UInt32;
  client @1 :Text;             # free-form, for logs
}
struct CtxCreate { flags @0 :UInt32; device @1 :Int32; }
struct Attach {
  ctx @0 :UInt64;
  token @1 :Data;
  # Optional staging area for bulk bytes when client and worker share a host: a sealed memfd
  # the client made, /proc/<pid>/fd/<fd> ("Pinned host memory" above says which it must be),
  # whose first 16 bytes equal shmCookie. The Result's
  # u64s[1] is 1 if the worker mapped it; calls then name byte ranges of it (viaShm).
  shmPath @2 :Text;
  shmCookie @3 :Data;
  shmSize @4 :UInt64;
}
struct Device { device @0 :Int32; }
struct DeviceAttribute { attribute @0 :Int32; device @1 :Int32; }
# cuDeviceGetP2PAttribute (and cuDeviceCanAccessPeer: its access attribute) between two distinct
# devices. Peer copies travel through the client (its contexts are workers of their own), so
# they work between any two devices; the answer is the devices' own, as the application would
# see it natively.
struct DeviceP2PAttribute { attribute @0 :Int32; device @1 :Int32; peer @2 :Int32; }
struct Handle { id @0 :UInt64; }       # module, function, stream or event id; stream 0 = default
struct Pointer { ptr @0 :UInt64; }
struct Flags { flags @0 :UInt32; }
# at: 0 to let the context place it, else the address of a mapping inside a range memReserve
# gave (cuMemMap)
struct MemAlloc { size @0 :UInt64; at @1 :UInt64; }
# cuMemAddressReserve: a range of the context's addresses that allocations are only mapped
# into (MemAlloc.at), as PyTorch's expandable segments grow. at: a wish, 0 for none.
struct MemReserve { size @0 :UInt64; alignment @1 :UInt64; at @2 :UInt64; }
# A copy split into chunks names the whole copy too (chunkOffset into it, totalSize), so
# the worker checks the whole range with every chunk: a bad copy fails entirely, as in CUDA.
struct MemcpyHtoD {
  dst @0 :UInt64; size @1 :UInt64; stream @2 :UInt64; payload @3 :UInt32;
  viaShm @4 :Bool; shmOffset @5 :UInt64; chunkOffset @6 :UInt64; totalSize @7 :UInt64;
}
struct MemcpyDtoH {
  src @0 :UInt64; size @1 :UInt64; stream @2 :UInt64;
  viaShm @3 :Bool; shmOffset @4 :UInt64; chunkOffset @5 :UInt64; totalSize @6 :UInt64;
}
struct MemcpyDtoD { dst @0 :UInt64; src @1 :UInt64; size @2 :UInt64; stream @3 :UInt64; }
# A client's pinned host range, a memfd it made ("Pinned host memory"): id is the
# client's name for it, size the application's bytes (after the header).
struct HostMap { id @0 :UInt64; path @1 :Text; cookie @2 :Data; size @3 :UInt64; address @4 :UInt64; }
# A copy between device address `device` and bytes [offset, offset + size) of pinned range
# `range` (hostMap's id), on `stream`: host->device with toDevice, else device->host. wait:
# answered once the copy is done (cuMemcpyHtoD/DtoH); else queued (their Async forms).
struct MemcpyPinned {
  device @0 :UInt64; range @1 :UInt64; offset @2 :UInt64; size @3 :UInt64; stream @4 :UInt64;
  toDevice @5 :Bool; wait @6 :Bool;
}
struct Memset { dst @0 :UInt64; value @1 :UInt32; elemSize @2 :UInt8; count @3 :UInt64; stream @4 :UInt64; }
# The image (PTX, cubin or fatbin) in payload; or, with payload 0, the image whose BLAKE2b-256
# digest is `digest`, which the server keeps from an earlier load (CUDA_ERROR_NOT_FOUND if it
# does not). A payload with its digest is kept for later loads, once the digest is checked.
struct ModuleLoad { payload @0 :UInt32; digest @1 :Data; }
struct ModuleSymbol { module @0 :UInt64; name @1 :Text; }
struct Launch {
  function @0 :UInt64;
  # grid x, y, z, block x, y, z, shared bytes and the launch options as eight little-endian
  # UInt32s, then the stream id as a little-endian UInt64 (40 bytes). One field instead of
  # nine: launches are the hot path, and each field costs the worker a read. Options: bits
  # 0-7, 8-15 and 16-23 the thread-block cluster's x, y and z (0: no cluster), bit 24 a
  # cooperative launch (cuLaunchKernelEx's attributes that change what a kernel may do).
  config @1 :Data;
  params @2 :Data;             # packed by the parameter layout of moduleGetFunction
}
struct StreamCreate { flags @0 :UInt32; priority @1 :Int32; }
struct StreamWaitEvent { stream @0 :UInt64; event @1 :UInt64; flags @2 :UInt32; }
struct EventRecord { event @0 :UInt64; stream @1 :UInt64; }
struct EventPair { start @0 :UInt64; end @1 :UInt64; }

