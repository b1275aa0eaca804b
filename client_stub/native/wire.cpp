// Cap'n Proto encoding of Requests and decoding of Replies (schema/phos.capnp).
#include "wire.h"

#include <cstring>
#include <type_traits>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include "parallel_copy.h"
#include "phos.capnp.h"   // generated at build time by `capnp compile -oc++`

namespace phos::wire {

const uint32_t kProtocolVersion = ::PROTOCOL_VERSION;

const char* kind_name(Kind kind) {
    static const char* const names[] = {
#define CALL(name, Member, mode, fields) #name,
#include "calls.def"
    };
    size_t i = static_cast<size_t>(kind);
    return i < sizeof names / sizeof names[0] ? names[i] : "?";
}

// A staged chunk the recovery log keeps is a 32 MiB copy out of its slot: on several threads,
// into bytes not written first (a std::string would zero them, one more pass on one core).
Payload Payload::copy_of(const void* src, size_t n) {
    Payload p;
    std::shared_ptr<char[]> bytes(new char[n]);
    copy_bulk(bytes.get(), src, n);
    p.owned = std::move(bytes);
    p.size = n;
    return p;
}

Payload Payload::borrow(const void* src, size_t n) {
    Payload p;
    p.borrowed = src;
    p.size = n;
    return p;
}

// -- factories: which fields each call uses --------------------------------------------

Call Call::hello(uint32_t version, std::string client) {
    Call c = plain(Kind::hello);
    c.flags = version;
    c.text = std::move(client);
    return c;
}
Call Call::ctx_create(uint32_t flags, int device) {
    Call c = plain(Kind::ctxCreate);
    c.flags = flags;
    c.device = device;
    return c;
}
Call Call::attach(uint64_t ctx, std::string token) {
    Call c = plain(Kind::attach);
    c.address = ctx;
    c.bytes = std::move(token);
    return c;
}
Call Call::reattach(uint64_t ctx, std::string token) {
    Call c = attach(ctx, std::move(token));
    c.kind = Kind::reattach;
    return c;
}
Call Call::attach_with_staging(uint64_t ctx, std::string token, std::string shm_path, std::string shm_cookie,
                               uint64_t shm_size) {
    Call c = attach(ctx, std::move(token));
    c.text = std::move(shm_path);
    c.bytes2 = std::move(shm_cookie);
    c.size = shm_size;
    return c;
}
Call Call::device_attribute(int attribute, int device) {
    Call c = plain(Kind::deviceGetAttribute);
    c.number = attribute;
    c.device = device;
    return c;
}
Call Call::p2p_attribute(int attribute, int device, int peer) {
    Call c = device_attribute(attribute, device);
    c.kind = Kind::deviceP2PAttribute;
    c.peer = peer;
    return c;
}
Call Call::mem_alloc(uint64_t size, uint64_t at) {
    Call c = plain(Kind::memAlloc);
    c.size = size;
    c.address = at;
    return c;
}
Call Call::mem_free(uint64_t ptr) {
    Call c = plain(Kind::memFree);
    c.address = ptr;
    return c;
}
Call Call::memcpy_htod(uint64_t dst, uint64_t stream, Payload bytes, bool wait) {
    Call c = plain(Kind::memcpyHtoD);
    c.address = dst;
    c.size = bytes.size;
    c.stream = stream;
    c.payload = std::move(bytes);
    c.flags = wait ? kWait : 0;
    return c;
}
Call Call::memcpy_dtoh(uint64_t src, uint64_t size, uint64_t stream, bool wait) {
    Call c = plain(Kind::memcpyDtoH);
    c.address = src;
    c.size = size;
    c.stream = stream;
    c.flags = wait ? kWait : 0;
    return c;
}
Call Call::memcpy_htod_staged(uint64_t dst, uint64_t size, uint64_t stream, uint64_t shm_offset,
                              uint64_t chunk_offset, uint64_t total_size) {
    Call c = plain(Kind::memcpyHtoD);
    c.address = dst;
    c.size = size;
    c.stream = stream;
    c.flags = kViaShm;
    c.id = shm_offset;
    c.id2 = chunk_offset;
    c.address2 = total_size;
    return c;
}
Call Call::memcpy_dtoh_staged(uint64_t src, uint64_t size, uint64_t stream, uint64_t shm_offset,
                              uint64_t chunk_offset, uint64_t total_size) {
    Call c = memcpy_dtoh(src, size, stream, false);
    c.flags = kViaShm;
    c.id = shm_offset;
    c.id2 = chunk_offset;
    c.address2 = total_size;
    return c;
}
Call Call::memcpy_dtod(uint64_t dst, uint64_t src, uint64_t size, uint64_t stream) {
    Call c = plain(Kind::memcpyDtoD);
    c.address = dst;
    c.address2 = src;
    c.size = size;
    c.stream = stream;
    return c;
}
Call Call::host_map(uint64_t id, std::string path, std::string cookie, uint64_t size, uint64_t address) {
    Call c = with_id(Kind::hostMap, id);
    c.address = address;
    c.text = std::move(path);
    c.bytes2 = std::move(cookie);
    c.size = size;
    return c;
}
Call Call::memcpy_pinned(uint64_t device, const void* host, uint64_t range, uint64_t offset, uint64_t size,
                         uint64_t stream, bool to_device, bool wait) {
    Call c = plain(Kind::memcpyPinned);
    c.address = device;
    c.address2 = reinterpret_cast<uint64_t>(host);
    c.id = range;
    c.id2 = offset;
    c.size = size;
    c.stream = stream;
    c.flags = (to_device ? kToDevice : 0) | (wait ? kWait : 0);
    return c;
}
Call Call::memset(uint64_t dst, uint32_t value, int elem_size, uint64_t count, uint64_t stream) {
    Call c = plain(Kind::memset);
    c.address = dst;
    c.flags = value;
    c.number = elem_size;
    c.size = count;
    c.stream = stream;
    return c;
}
Call Call::module_load(Payload image, std::string digest) {
    Call c = plain(Kind::moduleLoad);
    c.payload = std::move(image);
    c.text = std::move(digest);
    return c;
}
Call Call::module_symbol(Kind kind, uint64_t module, std::string name) {
    Call c = plain(kind);
    c.id = module;
    c.text = std::move(name);
    return c;
}
Call Call::launch(uint64_t function, Dim3 grid, Dim3 block, uint32_t shared_bytes, uint64_t stream,
                  std::string params, uint32_t options) {
    Call c = plain(Kind::launch);
    c.options = options;
    c.id = function;
    c.grid = grid;
    c.block = block;
    c.flags = shared_bytes;
    c.stream = stream;
    c.bytes = std::move(params);
    return c;
}
Call Call::stream_create(uint32_t flags, int priority) {
    Call c = plain(Kind::streamCreate);
    c.flags = flags;
    c.number = priority;
    return c;
}
Call Call::stream_wait_event(uint64_t stream, uint64_t event, uint32_t flags) {
    Call c = plain(Kind::streamWaitEvent);
    c.stream = stream;
    c.id2 = event;
    c.flags = flags;
    return c;
}
Call Call::event_create(uint32_t flags) {
    Call c = plain(Kind::eventCreate);
    c.flags = flags;
    return c;
}
Call Call::event_record(uint64_t event, uint64_t stream) {
    Call c = plain(Kind::eventRecord);
    c.id = event;
    c.stream = stream;
    return c;
}
Call Call::event_elapsed(uint64_t start, uint64_t end) {
    Call c = plain(Kind::eventElapsedTime);
    c.id = start;
    c.id2 = end;
    return c;
}

// -- encoding --------------------------------------------------------------------------

// Appends `value` as `n` little-endian bytes.
static char* put_le(char* out, uint64_t value, int n) {
    for (int b = 0; b < n; b++) *out++ = char(value >> (8 * b));
    return out;
}

std::array<char, 40> Call::launch_config() const {
    std::array<char, 40> config;
    char* out = config.data();
    for (uint32_t w : {grid.x, grid.y, grid.z, block.x, block.y, block.z, flags, options}) out = put_le(out, w, 4);
    put_le(out, stream, 8);
    return config;
}

void append_launch(Call& batch, const Call& launch) {
    // function id, Launch.config, params length, params (schema/wire.py, LAUNCH_RECORD)
    char head[8 + 40 + 4];
    put_le(head, launch.id, 8);
    const std::array<char, 40> config = launch.launch_config();
    std::memcpy(head + 8, config.data(), config.size());
    put_le(head + 48, launch.bytes.size(), 4);
    batch.bytes.append(head, sizeof head);
    batch.bytes += launch.bytes;
    batch.launches++;
    batch.seq = launch.seq;
}

// calls.def's field kinds: the type the field must have in the generated code (`fits`, checked
// when the encoder compiles), whether it is written (`present`), and the value its setter gets.
namespace field {

template <typename T>
struct Scalar {
    template <typename Field> static constexpr bool fits = std::is_same<Field, T>::value;
    template <typename V> static bool present(const V&) { return true; }
    template <typename Field, typename V> static T value(const V& v, uint32_t) { return static_cast<T>(v); }
};
using UInt8 = Scalar<uint8_t>;
using UInt32 = Scalar<uint32_t>;
using Int32 = Scalar<int32_t>;
using UInt64 = Scalar<uint64_t>;
using Bool = Scalar<bool>;

struct Enum {
    template <typename Field> static constexpr bool fits = std::is_enum<Field>::value;
    template <typename V> static bool present(const V&) { return true; }
    template <typename Field, typename V> static Field value(const V& v, uint32_t) { return static_cast<Field>(v); }
};

struct Text {
    template <typename Field> static constexpr bool fits = std::is_same<Field, capnp::Text::Builder>::value;
    static bool present(const std::string&) { return true; }
    template <typename Field> static const char* value(const std::string& s, uint32_t) { return s.c_str(); }
};
struct TextIfAny : Text {
    static bool present(const std::string& s) { return !s.empty(); }
};

struct Data {
    template <typename Field> static constexpr bool fits = std::is_same<Field, capnp::Data::Builder>::value;
    template <typename Bytes> static bool present(const Bytes&) { return true; }
    template <typename Field, typename Bytes> static capnp::Data::Reader value(const Bytes& b, uint32_t) {
        return capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(b.data()), b.size());
    }
};
struct DataIfAny : Data {
    static bool present(const std::string& s) { return !s.empty(); }
};

struct Frame {     // the call's payload frame: its index, which encode_request assigns
    template <typename Field> static constexpr bool fits = std::is_same<Field, uint32_t>::value;
    static bool present(const Payload&) { return true; }
    template <typename Field> static uint32_t value(const Payload&, uint32_t frame) { return frame; }
};

}  // namespace field

// One field of `b`, the struct being written, from call `c` (see calls.def).
#define FIELD(Field, slot, kind)                                                                        \
    {                                                                                                   \
        using Type = decltype(b.get##Field());                                                          \
        static_assert(field::kind::fits<Type>, "calls.def: " #Field " is no " #kind " in phos.capnp");  \
        if (field::kind::present(c.slot)) b.set##Field(field::kind::value<Type>(c.slot, frame));        \
    }

// Writes `c` into `out` as its row in calls.def says; `frame`: the index of its payload frame.
static void encode_call(const Call& c, ::Call::Builder out, uint32_t frame) {
    out.setSeq(c.seq);
    switch (c.kind) {
#define CALL(name, Member, mode, fields)   \
    case Kind::name: {                     \
        auto b = out.init##Member();       \
        fields                             \
        break;                             \
    }
#define CALL_VOID(name, Member, mode) \
    case Kind::name: out.set##Member(); break;
#define CALL_DATA(name, Member, mode, slot) \
    case Kind::name: {                      \
        ::Call::Builder& b = out;           \
        FIELD(Member, slot, Data)           \
        break;                              \
    }
#include "calls.def"
    }
}
#undef FIELD

static void write_frame(capnp::MessageBuilder& message, std::string& frame);

void encode_request(const Call* const* calls, size_t n, bool want_reply, std::string& frame) {
    capnp::MallocMessageBuilder message(2048);   // first segment in words; grows as needed
    auto request = message.initRoot<::Request>();
    request.setVersion(::PROTOCOL_VERSION);
    request.setWantReply(want_reply);
    auto list = request.initCalls(static_cast<unsigned>(n));
    uint32_t next_payload = 1;
    for (size_t i = 0; i < n; i++) {
        const Call& c = *calls[i];
        encode_call(c, list[static_cast<unsigned>(i)], c.has_payload() ? next_payload++ : 0);
    }
    write_frame(message, frame);
}

void encode_doorbell(std::string& frame) {
    capnp::MallocMessageBuilder message(16);
    auto request = message.initRoot<::Request>();
    request.setVersion(::PROTOCOL_VERSION);
    request.setDoorbell(true);
    write_frame(message, frame);
}

// Standard framing: u32 (segments - 1), u32 size of each segment, pad to 8 bytes, segments.
static void write_frame(capnp::MessageBuilder& message, std::string& frame) {
    auto segments = message.getSegmentsForOutput();
    size_t table_words = (segments.size() + 2) / 2;
    size_t total = table_words;
    for (auto s : segments) total += s.size();
    frame.resize(total * sizeof(capnp::word));
    char* out = &frame[0];
    std::memset(out, 0, table_words * sizeof(capnp::word));
    uint32_t count = static_cast<uint32_t>(segments.size() - 1);
    std::memcpy(out, &count, 4);
    for (size_t i = 0; i < segments.size(); i++) {
        uint32_t words = static_cast<uint32_t>(segments[i].size());
        std::memcpy(out + 4 + 4 * i, &words, 4);
    }
    out += table_words * sizeof(capnp::word);
    for (auto s : segments) {
        std::memcpy(out, s.begin(), s.size() * sizeof(capnp::word));
        out += s.size() * sizeof(capnp::word);
    }
}

// -- decoding --------------------------------------------------------------------------

static std::string text_of(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }

bool decode_reply(const void* frame, size_t size, Reply& reply, std::string& error) {
    if (size % sizeof(capnp::word) != 0 || size == 0) {
        error = "reply frame of " + std::to_string(size) + " bytes is not whole words";
        return false;
    }
    // zmq gives no alignment guarantee (small frames live inside the message object).
    std::vector<capnp::word> words(size / sizeof(capnp::word));
    std::memcpy(words.data(), frame, size);
    try {
        capnp::ReaderOptions options;
        options.traversalLimitInWords = 64u << 20;
        capnp::FlatArrayMessageReader message(kj::arrayPtr(words.data(), words.size()), options);
        auto r = message.getRoot<::Reply>();
        reply.ack_seq = r.getAckSeq();
        reply.durable_seq = r.getDurableSeq();
        reply.output = text_of(r.getOutput());
        reply.moved_endpoint.clear();
        reply.moved_standby.clear();
        reply.moved_server_key.clear();
        if (r.hasMoved()) {
            reply.moved_endpoint = text_of(r.getMoved().getEndpoint());
            reply.moved_standby = text_of(r.getMoved().getStandby());
            reply.moved_server_key = text_of(r.getMoved().getServerKey());
        }
        reply.moving_endpoint.clear();
        reply.moving_server_key.clear();
        if (r.hasMovingTo()) {
            reply.moving_endpoint = text_of(r.getMovingTo().getEndpoint());
            reply.moving_server_key = text_of(r.getMovingTo().getServerKey());
        }
        reply.results.clear();
        for (auto in : r.getResults()) {
            Result out;
            out.seq = in.getSeq();
            out.status = in.getStatus();
            out.message = text_of(in.getMessage());
            for (auto v : in.getU64s()) out.u64s.push_back(v);
            out.f64 = in.getF64();
            out.text = text_of(in.getText());
            auto data = in.getData();
            out.data.assign(reinterpret_cast<const char*>(data.begin()), data.size());
            out.payload = in.getPayload();
            for (auto p : in.getParams()) out.params.push_back(ParamInfo{p.getOffset(), p.getSize()});
            reply.results.push_back(std::move(out));
        }
        return true;
    } catch (const kj::Exception& e) {
        error = std::string("malformed reply: ") + e.getDescription().cStr();
        return false;
    }
}

}  // namespace phos::wire
