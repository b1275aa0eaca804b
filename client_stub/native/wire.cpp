// Cap'n Proto encoding of Requests and decoding of Replies (schema/phos.capnp).
#include "wire.h"

#include <cstring>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include "parallel_copy.h"
#include "phos.capnp.h"   // generated at build time by `capnp compile -oc++`

namespace phos::wire {

const uint32_t kProtocolVersion = ::PROTOCOL_VERSION;

const char* kind_name(Kind kind) {
    static const char* const names[] = {
        "hello", "ctxCreate", "attach",
        "driverGetVersion", "deviceGetCount", "deviceGetName", "deviceGetUuid", "deviceTotalMem",
        "deviceGetAttribute", "deviceComputeCapability",
        "ctxDestroy", "ctxSynchronize",
        "memAlloc", "memFree", "memGetInfo", "memGetAddressRange",
        "memcpyHtoD", "memcpyDtoH", "memcpyDtoD", "memset",
        "moduleLoad", "moduleUnload", "moduleGetFunction", "moduleGetGlobal", "launch",
        "streamCreate", "streamDestroy", "streamSynchronize", "streamQuery", "streamWaitEvent",
        "eventCreate", "eventRecord", "eventSynchronize", "eventQuery", "eventElapsedTime", "eventDestroy",
        "launchBatch", "reattach", "logFull", "tensorMapEncode", "funcOccupancy", "funcSetAttribute", "ctxLimit",
        "memReserve", "memUnreserve", "hostMap", "hostUnmap", "memcpyPinned", "deviceP2PAttribute",
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
Call Call::memcpy_htod(uint64_t dst, uint64_t stream, Payload bytes) {
    Call c = plain(Kind::memcpyHtoD);
    c.address = dst;
    c.size = bytes.size;
    c.stream = stream;
    c.payload = std::move(bytes);
    return c;
}
Call Call::memcpy_dtoh(uint64_t src, uint64_t size, uint64_t stream) {
    Call c = plain(Kind::memcpyDtoH);
    c.address = src;
    c.size = size;
    c.stream = stream;
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
    Call c = memcpy_dtoh(src, size, stream);
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

static capnp::Data::Reader as_data(const std::string& s) {
    return capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(s.data()), s.size());
}

// Appends `value` as `n` little-endian bytes.
static void put_le(std::string& out, uint64_t value, int n) {
    for (int b = 0; b < n; b++) out.push_back(char(value >> (8 * b)));
}

// Launch.config: grid xyz, block xyz, shared bytes, options (little-endian UInt32s), then the stream (UInt64).
static void put_launch_config(std::string& out, const Call& c) {
    const uint32_t words[8] = {c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z, c.flags, c.options};
    for (uint32_t w : words) put_le(out, w, 4);
    put_le(out, c.stream, 8);
}

void append_launch(Call& batch, const Call& launch) {
    // function id, Launch.config, params length, params (schema/wire.py, LAUNCH_RECORD)
    put_le(batch.bytes, launch.id, 8);
    put_launch_config(batch.bytes, launch);
    put_le(batch.bytes, launch.bytes.size(), 4);
    batch.bytes += launch.bytes;
    batch.launches++;
    batch.seq = launch.seq;
}

static void encode_call(const Call& c, ::Call::Builder out, uint32_t payload_index) {
    out.setSeq(c.seq);
    switch (c.kind) {
    case Kind::hello: {
        auto h = out.initHello();
        h.setVersion(c.flags);
        h.setClient(c.text.c_str());
        break;
    }
    case Kind::ctxCreate: {
        auto a = out.initCtxCreate();
        a.setFlags(c.flags);
        a.setDevice(c.device);
        break;
    }
    case Kind::attach: {
        auto a = out.initAttach();
        a.setCtx(c.address);
        a.setToken(as_data(c.bytes));
        if (!c.text.empty()) {
            a.setShmPath(c.text.c_str());
            a.setShmCookie(as_data(c.bytes2));
            a.setShmSize(c.size);
        }
        break;
    }
    case Kind::driverGetVersion: out.setDriverGetVersion(); break;
    case Kind::deviceGetCount: out.setDeviceGetCount(); break;
    case Kind::deviceGetName: out.initDeviceGetName().setDevice(c.device); break;
    case Kind::deviceGetUuid: out.initDeviceGetUuid().setDevice(c.device); break;
    case Kind::deviceTotalMem: out.initDeviceTotalMem().setDevice(c.device); break;
    case Kind::deviceGetAttribute: {
        auto a = out.initDeviceGetAttribute();
        a.setAttribute(c.number);
        a.setDevice(c.device);
        break;
    }
    case Kind::deviceComputeCapability: out.initDeviceComputeCapability().setDevice(c.device); break;
    case Kind::deviceP2PAttribute: {
        auto a = out.initDeviceP2PAttribute();
        a.setAttribute(c.number);
        a.setDevice(c.device);
        a.setPeer(c.peer);
        break;
    }
    case Kind::ctxDestroy: out.setCtxDestroy(); break;
    case Kind::ctxSynchronize: out.setCtxSynchronize(); break;
    case Kind::memAlloc: {
        auto m = out.initMemAlloc();
        m.setSize(c.size);
        m.setAt(c.address);
        break;
    }
    case Kind::memReserve: {     // size, alignment (address2), the address wished for
        auto m = out.initMemReserve();
        m.setSize(c.size);
        m.setAlignment(c.address2);
        m.setAt(c.address);
        break;
    }
    case Kind::memUnreserve: out.initMemUnreserve().setPtr(c.address); break;
    case Kind::memFree: out.initMemFree().setPtr(c.address); break;
    case Kind::hostMap: {
        auto h = out.initHostMap();
        h.setId(c.id);
        h.setPath(c.text.c_str());
        h.setCookie(as_data(c.bytes2));
        h.setSize(c.size);
        h.setAddress(c.address);
        break;
    }
    case Kind::hostUnmap: out.initHostUnmap().setId(c.id); break;
    case Kind::memcpyPinned: {
        auto m = out.initMemcpyPinned();
        m.setDevice(c.address);
        m.setRange(c.id);
        m.setOffset(c.id2);
        m.setSize(c.size);
        m.setStream(c.stream);
        m.setToDevice(c.flags & Call::kToDevice);
        m.setWait(c.flags & Call::kWait);
        break;
    }
    case Kind::memGetInfo: out.setMemGetInfo(); break;
    case Kind::memGetAddressRange: out.initMemGetAddressRange().setPtr(c.address); break;
    case Kind::memcpyHtoD: {
        auto m = out.initMemcpyHtoD();
        m.setDst(c.address);
        m.setSize(c.size);
        m.setStream(c.stream);
        if (c.flags & Call::kViaShm) {
            m.setViaShm(true);
            m.setShmOffset(c.id);
            m.setChunkOffset(c.id2);
            m.setTotalSize(c.address2);
        } else {
            m.setPayload(payload_index);
        }
        break;
    }
    case Kind::memcpyDtoH: {
        auto m = out.initMemcpyDtoH();
        m.setSrc(c.address);
        m.setSize(c.size);
        m.setStream(c.stream);
        if (c.flags & Call::kViaShm) {
            m.setViaShm(true);
            m.setShmOffset(c.id);
            m.setChunkOffset(c.id2);
            m.setTotalSize(c.address2);
        }
        break;
    }
    case Kind::memcpyDtoD: {
        auto m = out.initMemcpyDtoD();
        m.setDst(c.address);
        m.setSrc(c.address2);
        m.setSize(c.size);
        m.setStream(c.stream);
        break;
    }
    case Kind::memset: {
        auto m = out.initMemset();
        m.setDst(c.address);
        m.setValue(c.flags);
        m.setElemSize(static_cast<uint8_t>(c.number));
        m.setCount(c.size);
        m.setStream(c.stream);
        break;
    }
    case Kind::moduleLoad: {
        auto m = out.initModuleLoad();
        m.setPayload(payload_index);
        if (!c.text.empty()) m.setDigest(as_data(c.text));
        break;
    }
    case Kind::moduleUnload: out.initModuleUnload().setId(c.id); break;
    case Kind::moduleGetFunction: {
        auto s = out.initModuleGetFunction();
        s.setModule(c.id);
        s.setName(c.text.c_str());
        break;
    }
    case Kind::moduleGetGlobal: {
        auto s = out.initModuleGetGlobal();
        s.setModule(c.id);
        s.setName(c.text.c_str());
        break;
    }
    case Kind::launch: {
        auto l = out.initLaunch();
        l.setFunction(c.id);
        std::string config;
        put_launch_config(config, c);
        l.setConfig(as_data(config));
        l.setParams(as_data(c.bytes));
        break;
    }
    case Kind::streamCreate: {
        auto s = out.initStreamCreate();
        s.setFlags(c.flags);
        s.setPriority(c.number);
        break;
    }
    case Kind::streamDestroy: out.initStreamDestroy().setId(c.id); break;
    case Kind::streamSynchronize: out.initStreamSynchronize().setId(c.id); break;
    case Kind::streamQuery: out.initStreamQuery().setId(c.id); break;
    case Kind::streamWaitEvent: {
        auto s = out.initStreamWaitEvent();
        s.setStream(c.stream);
        s.setEvent(c.id2);
        s.setFlags(c.flags);
        break;
    }
    case Kind::eventCreate: out.initEventCreate().setFlags(c.flags); break;
    case Kind::eventRecord: {
        auto e = out.initEventRecord();
        e.setEvent(c.id);
        e.setStream(c.stream);
        break;
    }
    case Kind::eventSynchronize: out.initEventSynchronize().setId(c.id); break;
    case Kind::eventQuery: out.initEventQuery().setId(c.id); break;
    case Kind::eventElapsedTime: {
        auto e = out.initEventElapsedTime();
        e.setStart(c.id);
        e.setEnd(c.id2);
        break;
    }
    case Kind::eventDestroy: out.initEventDestroy().setId(c.id); break;
    case Kind::launchBatch: out.setLaunchBatch(as_data(c.bytes)); break;
    case Kind::logFull: out.setLogFull(); break;
    case Kind::funcSetAttribute: {
        auto a = out.initFuncSetAttribute();
        a.setFunction(c.id);
        a.setAttribute(c.number);
        a.setValue(static_cast<int32_t>(c.flags));
        break;
    }
    case Kind::ctxLimit: {
        auto l = out.initCtxLimit();
        l.setLimit(c.number);
        l.setValue(c.size);
        l.setSet(c.flags != 0);
        break;
    }
    case Kind::funcOccupancy: {
        auto o = out.initFuncOccupancy();
        o.setFunction(c.id);
        o.setQuery(static_cast<::FuncOccupancy::Query>(c.number));
        o.setA(c.address);
        o.setB(c.size);
        o.setFlags(c.flags);
        o.setGrid(c.address2);
        break;
    }
    case Kind::tensorMapEncode: {
        auto t = out.initTensorMapEncode();
        t.setIm2col(c.flags != 0);
        t.setArgs(as_data(c.bytes));
        break;
    }
    case Kind::reattach: {
        auto a = out.initReattach();
        a.setCtx(c.address);
        a.setToken(as_data(c.bytes));
        break;
    }
    }
}

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
