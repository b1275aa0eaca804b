// The calls of schema/phos.capnp as plain C++ values, and their Cap'n Proto encoding.
//
// A Call is kept in a batch, then in the replay log until the server acknowledges it
// (with recovery on, until a recovery image holds it), so it owns everything it needs, or
// borrows memory that outlives the acknowledgement (never with recovery on).
// Only wire.cpp sees Cap'n Proto types.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace phos::wire {

// Every call, as calls.def lists them.
enum class Kind : uint8_t {
#define CALL(name, Member, mode, fields) name,
#include "calls.def"
};

// How a driver entry point sends a call (calls.def's mode column).
enum class Mode : uint8_t { sync, async, stream, copy };

constexpr Mode kModes[] = {
#define CALL(name, Member, mode, fields) Mode::mode,
#include "calls.def"
};
constexpr Mode mode_of(Kind kind) { return kModes[static_cast<size_t>(kind)]; }

const char* kind_name(Kind kind);

struct Dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

// Bulk bytes that travel as their own frame after the Request frame.
struct Payload {
    std::shared_ptr<const char[]> owned;        // bytes captured from the caller (not zeroed first: copy_of)
    const void* borrowed = nullptr;             // caller memory, unchanged until acknowledged
    size_t size = 0;

    const void* data() const { return owned ? static_cast<const void*>(owned.get()) : borrowed; }
    static Payload copy_of(const void* src, size_t n);
    static Payload borrow(const void* src, size_t n);
};

// One call. calls.def says which member holds each field of its kind's schema struct; the
// factories below fill them.
struct Call {
    uint64_t seq = 0;
    Kind kind = Kind::hello;
    uint64_t address = 0;     // dst (memcpyHtoD, memcpyDtoD, memset), src (memcpyDtoH), ptr, ctx (attach)
    uint64_t address2 = 0;    // src of memcpyDtoD; totalSize of a staged copy; the host address of a memcpyPinned
    uint64_t size = 0;        // bytes; element count for memset; shmSize (attach)
    uint64_t stream = 0;      // stream id (0 = default)
    uint64_t id = 0;          // a Handle's id; module; function; event; start event; shmOffset of a staged copy;
                              // a pinned range's (hostMap, memcpyPinned)
    uint64_t id2 = 0;         // end event; event of streamWaitEvent; chunkOffset of a staged copy; offset
                              // into a pinned range
    uint32_t flags = 0;       // flags; memset value; launch shared bytes; hello version; kViaShm, kWait (copies)
    int32_t device = 0;       // device ordinal
    int32_t peer = 0;         // the other device of deviceP2PAttribute
    int32_t number = 0;       // device attribute; stream priority; memset element size
    Dim3 grid, block;
    std::string text;         // hello client; symbol name; shmPath (attach); path (hostMap)
    std::string bytes;        // attach token; packed launch parameters; launchBatch records
    std::string bytes2;       // shmCookie (attach); cookie (hostMap)
    Payload payload;          // memcpyHtoD bytes; moduleLoad image
    uint32_t launches = 0;    // launchBatch: how many records `bytes` holds
    uint32_t options = 0;     // launch: Launch.config's options (cluster, cooperative; phos.capnp)
    bool wanted = false;      // sent last in a Request with wantReply: someone waits for its Result
    bool ends = false;        // sent last in a Request: a resend ends one there too (frames stay small)

    static constexpr uint32_t kViaShm = 1;   // a copy whose bytes lie in the shared staging area
    // a moduleLoad sent by its digest (text) alone: the server keeps the image from before
    static constexpr uint32_t kByDigest = 2;
    // memcpyPinned: host->device (else device->host)
    static constexpr uint32_t kToDevice = 4;
    // a copy its caller waits for (calls.def's mode copy); memcpyPinned tells the worker, to answer once done
    static constexpr uint32_t kWait = 8;
    bool via_shm() const { return (kind == Kind::memcpyHtoD || kind == Kind::memcpyDtoH) && (flags & kViaShm); }
    bool has_payload() const {
        return (kind == Kind::memcpyHtoD && !(flags & kViaShm)) || (kind == Kind::moduleLoad && !(flags & kByDigest));
    }
    // Its Result comes with a payload frame (so its Reply cannot travel through the mailbox).
    bool answered_by_frames() const { return kind == Kind::memcpyDtoH && !(flags & kViaShm); }
    // How many API calls it stands for: a launchBatch, one per launch; the rest, one.
    size_t calls() const { return kind == Kind::launchBatch ? launches : 1; }
    // A launch's Launch.config (schema/phos.capnp): grid xyz, block xyz, shared bytes (flags) and
    // options as little-endian UInt32s, then the stream as a UInt64.
    std::array<char, 40> launch_config() const;

    static Call plain(Kind kind) { Call c; c.kind = kind; return c; }
    static Call with_id(Kind kind, uint64_t id) { Call c; c.kind = kind; c.id = id; return c; }
    static Call on_device(Kind kind, int device) { Call c; c.kind = kind; c.device = device; return c; }
    static Call hello(uint32_t version, std::string client);
    static Call ctx_create(uint32_t flags, int device);
    static Call attach(uint64_t ctx, std::string token);
    // To a front end: where does context `ctx` live now? (Result text: its worker endpoint)
    static Call reattach(uint64_t ctx, std::string token);
    // attach, offering the shared staging area (schema/phos.capnp, Attach).
    static Call attach_with_staging(uint64_t ctx, std::string token, std::string shm_path, std::string shm_cookie,
                                    uint64_t shm_size);
    static Call device_attribute(int attribute, int device);
    // cuDeviceGetP2PAttribute's `attribute` from `device` to `peer` (two distinct devices)
    static Call p2p_attribute(int attribute, int device, int peer);
    static Call mem_alloc(uint64_t size, uint64_t at = 0);   // at: a mapping's address (cuMemMap)
    static Call mem_free(uint64_t ptr);
    // wait: the caller waits for the copy (else it is queued; a device->host one lands with a later Reply)
    static Call memcpy_htod(uint64_t dst, uint64_t stream, Payload bytes, bool wait);
    static Call memcpy_dtoh(uint64_t src, uint64_t size, uint64_t stream, bool wait);
    // One chunk of a copy through the staging area: its bytes at shm_offset of the area;
    // chunk_offset and total_size name the whole copy, which the worker checks every time.
    static Call memcpy_htod_staged(uint64_t dst, uint64_t size, uint64_t stream, uint64_t shm_offset,
                                   uint64_t chunk_offset, uint64_t total_size);
    static Call memcpy_dtoh_staged(uint64_t src, uint64_t size, uint64_t stream, uint64_t shm_offset,
                                   uint64_t chunk_offset, uint64_t total_size);
    static Call memcpy_dtod(uint64_t dst, uint64_t src, uint64_t size, uint64_t stream);
    // Pinned host memory the worker maps (schema/phos.capnp, "Pinned host memory"): a range's
    // announcement, its end, and a copy between the device and `host`, which lies at `offset`
    // of range `range` (the address stays here: a resend carries the bytes themselves).
    // address: map the range there (the application's own address) for the device to use in place
    static Call host_map(uint64_t id, std::string path, std::string cookie, uint64_t size, uint64_t address = 0);
    static Call host_unmap(uint64_t id) { return with_id(Kind::hostUnmap, id); }
    static Call memcpy_pinned(uint64_t device, const void* host, uint64_t range, uint64_t offset, uint64_t size,
                              uint64_t stream, bool to_device, bool wait);
    static Call memset(uint64_t dst, uint32_t value, int elem_size, uint64_t count, uint64_t stream);
    // digest: the image's BLAKE2b-256 (blake2b.h), so the server keeps it; empty: not kept
    static Call module_load(Payload image, std::string digest = "");
    static Call module_symbol(Kind kind, uint64_t module, std::string name);
    static Call launch(uint64_t function, Dim3 grid, Dim3 block, uint32_t shared_bytes, uint64_t stream,
                       std::string params, uint32_t options = 0);
    static Call stream_create(uint32_t flags, int priority);
    static Call stream_wait_event(uint64_t stream, uint64_t event, uint32_t flags);
    static Call event_create(uint32_t flags);
    static Call event_record(uint64_t event, uint64_t stream);
    static Call event_elapsed(uint64_t start, uint64_t end);
    // An empty launchBatch; append_launch fills it.
    static Call launch_batch() { return plain(Kind::launchBatch); }
};

// Appends a launch (a Call::launch) to a launchBatch as one record (schema/phos.capnp,
// "Launch batches"); the batch takes the launch's seq, so it holds the seq of its last launch.
void append_launch(Call& batch, const Call& launch);

struct ParamInfo {
    uint32_t offset = 0, size = 0;
};

struct Result {
    uint64_t seq = 0;
    uint32_t status = 0;          // a CUresult
    std::string message;
    std::vector<uint64_t> u64s;
    double f64 = 0;
    std::string text;
    std::string data;
    uint32_t payload = 0;         // index of the reply frame holding bulk bytes (0: none)
    std::vector<ParamInfo> params;
};

struct Reply {
    uint64_t ack_seq = 0;
    std::vector<Result> results;
    std::string output;           // device-side printf output
    uint64_t durable_seq = 0;     // recovery: calls up to it are in the latest image (0: no news)
    std::string moved_endpoint;   // handed off: the worker that holds the context now ("" none)
    std::string moved_standby;    // ...and the standby of its server
    std::string moved_server_key; // ...and its server's CURVE public key (z85; "" none)
    std::string moving_endpoint;  // a handoff is about to move the context to this worker: connect ahead
    std::string moving_server_key;    // ...and its server's CURVE public key (z85; "" none)
};

extern const uint32_t kProtocolVersion;

// Encodes calls[0..n) as one Request frame (standard unpacked Cap'n Proto framing).
// Payload indices are assigned in call order: the k-th call with a payload names frame k.
void encode_request(const Call* const* calls, size_t n, bool want_reply, std::string& frame);

// A Request with doorbell=true and no calls: "a request waits in the mailbox".
void encode_doorbell(std::string& frame);

// Decodes a Reply frame; on a malformed frame returns false and says why in `error`.
bool decode_reply(const void* frame, size_t size, Reply& reply, std::string& error);

}  // namespace phos::wire
