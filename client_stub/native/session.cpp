#include "session.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "common.h"
#include "parallel_copy.h"
#include "phos.capnp.h"   // generated at build time by `capnp compile -oc++`

namespace phos {

// The shared staging area's layout: schema/phos.capnp's staging* constants (its header comment).
namespace staging {
constexpr size_t kCookieBytes = ::STAGING_COOKIE_BYTES;
constexpr size_t kAwakeOffset = ::STAGING_AWAKE_OFFSET;     // UInt64 workerAwake
constexpr size_t kAsleepOffset = ::STAGING_ASLEEP_OFFSET;   // UInt64 clientAsleep
constexpr size_t kBoxOffset = ::STAGING_BOX_OFFSET;         // request box; the reply box follows
constexpr size_t kBoxSize = ::STAGING_BOX_SIZE;             // UInt64 seq, UInt64 len, then a frame
constexpr size_t kSlotsOffset = ::STAGING_SLOTS_OFFSET;
constexpr size_t kSlotSize = ::STAGING_SLOT_SIZE;           // two bulk slots, used in turn
constexpr size_t kAreaSize = kSlotsOffset + 2 * kSlotSize;
const size_t kMinCopy = ::STAGING_MIN_COPY;                 // smaller copies travel in frames
static_assert(kSlotsOffset == kBoxOffset + 2 * kBoxSize, "schema/phos.capnp: the slots follow the two boxes");
}  // namespace staging

// A pinned host file's header (schema/phos.capnp, "Pinned host memory"): the cookie, then zeros.
constexpr size_t kPinnedHeader = ::PINNED_HEADER_BYTES;

using Clock = std::chrono::steady_clock;

// CUresult values this file produces on its own.
constexpr uint32_t kNoDevice = 100;            // CUDA_ERROR_NO_DEVICE
constexpr uint32_t kContextIsDestroyed = 709;  // CUDA_ERROR_CONTEXT_IS_DESTROYED
constexpr uint32_t kNotPermitted = 800;        // CUDA_ERROR_NOT_PERMITTED
constexpr uint32_t kUnknown = 999;             // CUDA_ERROR_UNKNOWN

// Keep a Request frame well under the server's 1 MiB limit on control frames.
constexpr size_t kMaxFrameEstimate = 256 << 10;

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

Connection::Connection(const std::string& endpoint, bool batching) : socket_(endpoint), batching_(batching) {
    batch_.reserve(static_cast<size_t>(settings().batch_calls));
}

Connection::~Connection() {
    if (shm_) munmap(shm_, staging::kAreaSize);
    for (char* area : old_areas_) munmap(area, staging::kAreaSize);
}

wire::Result Connection::failure(uint32_t status, std::string message) {
    wire::Result r;
    r.status = status;
    r.message = std::move(message);
    return r;
}

std::string Connection::stats() const {
    char text[320];
    snprintf(text, sizeof text,
             "%llu requests through the mailbox, %llu over the socket, %llu doorbells, %llu bytes staged, "
             "%llu bytes copied in place (pinned)",
             (unsigned long long)box_requests_, (unsigned long long)socket_requests_, (unsigned long long)doorbells_,
             (unsigned long long)staged_bytes_, (unsigned long long)pinned_bytes_);
    std::vector<std::pair<int, std::pair<uint64_t, double>>> waits(waits_.begin(), waits_.end());
    std::sort(waits.begin(), waits.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
    std::string out = text;
    for (size_t i = 0; i < waits.size() && i < 5; i++) {
        snprintf(text, sizeof text, "%s %s %llu in %.1f ms", i ? "," : "; waited for", wire::kind_name(static_cast<wire::Kind>(waits[i].first)),
                 (unsigned long long)waits[i].second.first, waits[i].second.second * 1e3);
        out += text;
    }
    return out;
}

void Connection::post(wire::Call call, const HostDestination* write_back) {
    call.seq = next_seq_++;
    if (write_back) write_backs_[call.seq] = *write_back;
    if (batch_.empty()) batch_started_ = Clock::now();
    batch_payload_bytes_ += call.payload.size;
    batch_frame_estimate_ += 96 + call.text.size() + call.bytes.size();
    batch_calls_++;
    if (call.kind == wire::Kind::launch) {
        // Consecutive launches travel as one launchBatch (schema/phos.capnp, "Launch batches").
        if (batch_.empty() || batch_.back().kind != wire::Kind::launchBatch) batch_.push_back(wire::Call::launch_batch());
        wire::append_launch(batch_.back(), call);
    } else {
        batch_.push_back(std::move(call));
    }
    const Settings& s = settings();
    if (!batching_ || batch_calls_ >= static_cast<size_t>(s.batch_calls) ||
        batch_payload_bytes_ >= static_cast<size_t>(s.batch_bytes) || batch_frame_estimate_ >= kMaxFrameEstimate ||
        seconds_since(batch_started_) >= std::min(batch_age_, s.batch_age)) {
        batch_age_ = std::min(2 * batch_age_, s.batch_age);
        send_batch(false);
    }
}

void Connection::flush_if_stale() {
    if (!batch_.empty() && seconds_since(batch_started_) >= settings().batch_age) send_batch(false);
}

// -- sending ---------------------------------------------------------------------------

// Encodes batch_[begin, end) as one Request and sends it with its payload frames.
bool Connection::send_socket(size_t begin, size_t end, bool want_reply) {
    std::vector<const wire::Call*> calls;
    std::vector<const wire::Payload*> payloads;
    calls.reserve(end - begin);
    for (size_t i = begin; i < end; i++) {
        calls.push_back(&batch_[i]);
        if (batch_[i].has_payload()) payloads.push_back(&batch_[i].payload);
    }
    wire::encode_request(calls.data(), calls.size(), want_reply, frame_);
    socket_requests_++;
    const bool sent = socket_.send(frame_, payloads);
    if (!sent) log_error("%s: %s", endpoint().c_str(), socket_.error().c_str());
    return sent;
}

static uint64_t* word_at(char* shm, size_t offset) { return reinterpret_cast<uint64_t*>(shm + offset); }

// The mailbox pays while both sides spin: the worker watching the box (workerAwake) and
// we watching the reply box. A worker asleep needs the doorbell, a socket message, and
// then answers over the socket; a client that sleeps is woken sooner by a socket Reply
// than it finds one in the box. In those cases the socket does as well, for less.
bool Connection::use_mailbox() const {
    const int mode = settings().mailbox;
    if (mode >= 0) return mode == 1;
    return settings().spin > 0 && __atomic_load_n(word_at(shm_, staging::kAwakeOffset), __ATOMIC_ACQUIRE) != 0;
}

// A call that may travel through the mailbox: no payload frames, none in its Result.
bool Connection::boxable(const wire::Call& c) const { return !c.has_payload() && !c.answered_by_frames(); }

// Sends the batch. A batch that ends with a synchronous call (`use_box`) goes through
// the mailbox when it can: the calls with payload frames before it go over the socket
// first (the worker runs them before the mailbox request, whose first seq is later).
bool Connection::send_batch(bool want_reply, bool use_box) {
    if (batch_.empty()) return true;
    if (!dead_.empty()) {   // the context is lost (reattach): calls go nowhere, and fail
        batch_.clear();
        batch_payload_bytes_ = batch_frame_estimate_ = batch_calls_ = 0;
        return false;
    }
    bool sent = true, boxed = false;
    if (want_reply && use_box && shm_ && use_mailbox()) {
        size_t split = batch_.size();
        while (split > 0 && boxable(batch_[split - 1])) split--;
        if (split < batch_.size()) {
            std::vector<const wire::Call*> calls;
            calls.reserve(batch_.size() - split);
            for (size_t i = split; i < batch_.size(); i++) calls.push_back(&batch_[i]);
            wire::encode_request(calls.data(), calls.size(), true, frame_);
            if (frame_.size() <= staging::kBoxSize - 16) {
                std::string boxed_frame;
                boxed_frame.swap(frame_);
                if (split > 0) sent = send_socket(0, split, false);
                frame_.swap(boxed_frame);
                if (sent) {
                    post_to_box();
                    boxed = true;
                }
            }
        }
    }
    if (!boxed && sent) sent = send_socket(0, batch_.size(), want_reply);
    if (want_reply) {
        batch_.back().wanted = true;   // a re-attach resends it last in a Request too
        // A call that waits for its answer may leave the device idle: the calls after it go out
        // once the first is kRampAge old, not PHOS_BATCH_AGE_US (1 ms of a PyTorch step's kernels
        // held back behind each sync), and each batch may wait twice as long as the last.
        batch_age_ = kRampAge;
    }
    batch_.back().ends = true;
    for (auto& c : batch_) log_call(std::move(c));
    batch_.clear();
    batch_payload_bytes_ = batch_frame_estimate_ = batch_calls_ = 0;
    if (!want_reply) bound_log();
    return sent;
}


// Puts frame_ in the request box: the bytes, then len, then seq (release: the worker that
// sees the seq sees the rest). Rings the doorbell if the worker is not watching the box.
void Connection::post_to_box() {
    char* box = shm_ + staging::kBoxOffset;
    std::memcpy(box + 16, frame_.data(), frame_.size());
    __atomic_store_n(word_at(box, 8), static_cast<uint64_t>(frame_.size()), __ATOMIC_RELEASE);
    __atomic_store_n(word_at(box, 0), ++box_seq_, __ATOMIC_RELEASE);
    box_waiting_ = true;
    box_requests_++;
    // Our store of seq must be visible before we read workerAwake (a store-load order).
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(word_at(shm_, staging::kAwakeOffset), __ATOMIC_ACQUIRE) == 0) {
        // Encoded here, not in a function-local static: that one would be destroyed
        // before the exit handler's ctxDestroy rings.
        if (bell_.empty()) wire::encode_doorbell(bell_);
        doorbells_++;
        if (!socket_.send(bell_, {})) log_error("%s: %s", endpoint().c_str(), socket_.error().c_str());
    }
}

// The reply box holds the Reply to our waiting mailbox request.
bool Connection::box_answered(const char** frame, size_t* size) {
    char* box = shm_ + staging::kBoxOffset + staging::kBoxSize;
    if (__atomic_load_n(word_at(box, 0), __ATOMIC_ACQUIRE) != box_seq_) return false;
    *size = std::min<uint64_t>(__atomic_load_n(word_at(box, 8), __ATOMIC_ACQUIRE), staging::kBoxSize - 16);
    *frame = box + 16;
    return true;
}

// Sends a call at once with wantReply, without waiting; returns its seq.
uint64_t Connection::send_now(wire::Call call) {
    call.seq = next_seq_++;
    const uint64_t seq = call.seq;
    batch_.push_back(std::move(call));
    send_batch(true);
    return seq;
}

// -- the replay log --------------------------------------------------------------------

// A staged copy travels in frames instead: host->device with the bytes of its slot in
// `area` (the slot will be reused, or the area belongs to a worker gone by), device->host
// answered in a frame.
static void unstage(wire::Call& c, const char* area) {
    if (c.kind == wire::Kind::memcpyHtoD) c.payload = wire::Payload::copy_of(area + c.id, c.size);   // id: shmOffset
    c.flags &= ~wire::Call::kViaShm;
    c.id = c.id2 = c.address2 = 0;
}

// A copy that named a pinned range travels in frames instead (the worker it goes to may not
// map the range, and the range's bytes may have changed since): host->device with its bytes,
// device->host answered in a frame.
static void unpin(wire::Call& c) {
    const auto* host = reinterpret_cast<const char*>(c.address2);
    wire::Call framed = (c.flags & wire::Call::kToDevice)
                            ? wire::Call::memcpy_htod(c.address, c.stream, wire::Payload::copy_of(host, c.size), false)
                            : wire::Call::memcpy_dtoh(c.address, c.size, c.stream, false);
    framed.seq = c.seq;
    framed.ends = c.ends;
    framed.wanted = c.wanted;
    c = std::move(framed);
}

// A call that reads and changes nothing in its place (memGetInfo): a resend of it drops its Result.
static wire::Call as_nothing(const wire::Call& c) {
    wire::Call nothing = wire::Call::plain(wire::Kind::memGetInfo);
    nothing.seq = c.seq;
    nothing.ends = c.ends;
    nothing.wanted = c.wanted;
    return nothing;
}

// The host bytes a logged call holds: its own payload, a launchBatch's records.
static size_t held_bytes(const wire::Call& c) {
    return (c.payload.owned ? c.payload.size : 0) + (c.kind == wire::Kind::launchBatch ? c.bytes.size() : 0);
}

// Keeps a sent call for replay. With recovery the log outlives acknowledgements, so a call
// keeps its own bytes: caller memory may change and a staging slot is reused once answered.
void Connection::log_call(wire::Call c) {
    // A replay may go to a server that never kept the image: it carries the image again.
    if (c.kind == wire::Kind::moduleLoad) c.flags &= ~wire::Call::kByDigest;
    if (c.kind == wire::Kind::memcpyPinned) {
        pinned_seq_ = c.seq;
        pinned_bytes_ += c.size;
    }
    if (recovery_) {
        if (c.kind == wire::Kind::memcpyHtoD && c.via_shm()) unstage(c, shm_);
        else if (c.kind == wire::Kind::memcpyPinned && (c.flags & wire::Call::kToDevice)) unpin(c);
        else if (c.payload.borrowed) c.payload = wire::Payload::copy_of(c.payload.borrowed, c.payload.size);
    }
    log_bytes_ += held_bytes(c);
    if (c.payload.borrowed) borrowed_unacked_++;
    unacked_calls_ += c.calls();
    unacked_.push_back(std::move(c));
}

void Connection::replay_as_nothing(uint64_t seq) {
    for (auto it = unacked_.rbegin(); it != unacked_.rend(); ++it) {
        if (it->seq != seq) continue;
        log_bytes_ -= held_bytes(*it);
        if (it->payload.borrowed) borrowed_unacked_--;
        *it = as_nothing(*it);   // its Result was delivered, so a resend drops it
        return;
    }
}

bool Connection::log_full() const {
    const Settings& s = settings();
    return unacked_calls_ >= static_cast<size_t>(s.log_calls) || log_bytes_ >= static_cast<size_t>(s.log_bytes);
}

// The replay log only shrinks when a Reply acknowledges calls (with recovery, when an image
// holds them), and asynchronous calls get no Reply. If it grows too long, ask for one with
// a cheap synchronous call; with recovery, ask for an image.
void Connection::bound_log() {
    if (!batching_ || bounding_ || reattaching_ || !dead_.empty() || !log_full()) return;
    bounding_ = true;
    if (recovery_) wait_for_image();
    else defer(call(wire::Call::plain(wire::Kind::memGetInfo)));   // a failure: the next synchronizing call says so
    bounding_ = false;
}

// Asks for a recovery image (logFull, answered with the durable seq) every 5 ms until the
// log, trimmed to the image's cut, is within its bounds. After PHOS_REATTACH_TIMEOUT
// seconds the next synchronizing call fails, saying why, and the log goes back to being
// trimmed by acknowledgements (so nothing waits that long again; recovery is then off).
void Connection::wait_for_image() {
    const auto start = Clock::now();
    while (true) {
        wire::Result r = call(wire::Call::plain(wire::Kind::logFull));
        if (r.status != 0) {
            defer(r);
            return;
        }
        advance(0, r.u64s.empty() ? 0 : r.u64s[0]);
        if (!log_full()) {
            log_verbose("context %llu: the recovery log was full; after %.3f s an image at call %llu shortened it",
                        (unsigned long long)ctx_, seconds_since(start), (unsigned long long)durable_);
            return;
        }
        if (seconds_since(start) >= settings().reattach_timeout) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    char text[512];
    snprintf(text, sizeof text,
             "the recovery log of context %llu holds %zu calls and %zu bytes (PHOS_LOG_CALLS, PHOS_LOG_BYTES) and "
             "its worker took no image that shortens it within %g s: recovery is off for this context",
             (unsigned long long)ctx_, unacked_calls_, log_bytes_, settings().reattach_timeout);
    log_error("%s", text);
    defer(failure(kUnknown, text));
    recovery_ = false;
    trim_log(log_floor());
}

// A Reply (or logFull) acknowledged calls up to `ack`, and an image holds those up to
// `durable` (0: no news): the log keeps the calls after log_floor().
void Connection::advance(uint64_t ack, uint64_t durable) {
    acked_ = std::max(acked_, ack);
    durable_ = std::max(durable_, durable);
    trim_log(log_floor());
}

void Connection::trim_log(uint64_t seq) {
    while (!unacked_.empty() && unacked_.front().seq <= seq) {
        const wire::Call& c = unacked_.front();
        log_bytes_ -= held_bytes(c);
        if (c.payload.borrowed) borrowed_unacked_--;
        unacked_calls_ -= c.calls();
        unacked_.pop_front();
    }
}

// -- replies ---------------------------------------------------------------------------

// Remembers a failure the server reported for a call nobody waited for; the next
// synchronous call reports it (the first one wins).
void Connection::defer(const wire::Result& r) {
    if (r.status == 0 || deferred_status_ != 0) return;
    deferred_status_ = r.status;
    deferred_message_ = r.message;
}

wire::Result Connection::take_deferred() {
    wire::Result r = failure(deferred_status_, std::move(deferred_message_));
    deferred_status_ = 0;
    deferred_message_.clear();
    return r;
}

static void copy_payload(Message* message, uint32_t index, const HostDestination& to) {
    if (!message || index == 0 || index >= message->count() || !to.dst) return;
    copy_bulk(to.dst, message->data(index), std::min(to.size, message->size(index)));
}

// Applies one Reply (from the socket, with its frames, or from the reply box, without):
// acknowledges calls, delivers bytes and printf output, notes failures of staged chunks.
// Returns whether it held the Result of `want_seq` (or refused a whole Request: seq 0).
bool Connection::apply_reply(const void* frame, size_t size, Message* message, uint64_t want_seq,
                             const HostDestination* out, wire::Result& mine) {
    wire::Reply reply;
    std::string error;
    if (!wire::decode_reply(frame, size, reply, error)) {
        log_error("%s: %s", endpoint().c_str(), error.c_str());
        return false;
    }
    advance(reply.ack_seq, reply.durable_seq);
    if (!reply.moved_endpoint.empty()) {   // handed off: re-attach there (wait_for), asking no front end
        moved_to_ = reply.moved_endpoint;
        if (!reply.moved_standby.empty()) standby_ = reply.moved_standby;
        // a server with keys of its own: its worker is authenticated by them
        if (!reply.moved_server_key.empty()) remember_server_key(reply.moved_endpoint, reply.moved_server_key);
    }
    if (!reply.moving_endpoint.empty()) {   // a handoff is about to move it there: connect ahead (attach_again)
        if (!reply.moving_server_key.empty()) remember_server_key(reply.moving_endpoint, reply.moving_server_key);
        if (!ahead_ || ahead_->endpoint() != reply.moving_endpoint) ahead_ = std::make_unique<Socket>(reply.moving_endpoint);
    }
    if (!reply.output.empty()) {   // device-side printf, shown at synchronization as CUDA does
        fwrite(reply.output.data(), 1, reply.output.size(), stdout);
        fflush(stdout);
    }
    bool found = false;
    for (auto& r : reply.results) {
        if (r.seq != want_seq && r.seq != 0 && r.seq <= answered_) continue;   // resent, answered before: drop
        if (r.seq == want_seq || (r.seq == 0 && r.status != 0)) {   // seq 0: the whole Request was refused
            if (out && r.status == 0) copy_payload(message, r.payload, *out);
            auto it = r.seq ? write_backs_.find(r.seq) : write_backs_.end();   // a resent staged copy
            if (it != write_backs_.end()) {
                if (r.status == 0) copy_payload(message, r.payload, it->second);
                write_backs_.erase(it);
            }
            if (r.seq == 0) kept_.clear();   // which chunk it was is unknown: stop waiting for any
            mine = std::move(r);
            found = true;
            continue;
        }
        if (kept_.erase(r.seq)) {
            defer(r);
            continue;
        }
        auto it = write_backs_.find(r.seq);
        if (it != write_backs_.end()) {
            if (r.status == 0) copy_payload(message, r.payload, it->second);
            write_backs_.erase(it);
        }
    }
    for (auto it = write_backs_.begin(); it != write_backs_.end();) {   // executed, but no bytes came
        it = it->first <= reply.ack_seq ? write_backs_.erase(it) : std::next(it);
    }
    return found;
}

// Receives Replies, from the reply box and the socket, until one holds `seq`'s Result.
// Spins for PHOS_SPIN_US first, then says so in clientAsleep (the worker then answers over
// the socket) and sleeps in short, growing waits on it. False, with `mine` saying why, on
// timeout or loss.
bool Connection::wait_for(uint64_t seq, const HostDestination* out, double timeout, wire::Result& mine) {
    if (!dead_.empty()) {
        mine = failure(kContextIsDestroyed, dead_);
        return false;
    }
    const auto start = Clock::now();
    const double spin = settings().spin;
    double nap = 20e-6;
    bool told_asleep = false;
    Message message;
    for (unsigned round = 0;; round++) {
        const char* frame;
        size_t size;
        if (box_waiting_ && box_answered(&frame, &size)) {
            box_waiting_ = false;
            if (apply_reply(frame, size, nullptr, seq, out, mine)) return true;
            continue;
        }
        const double waited = seconds_since(start);
        Socket::Wait w;
        if (waited < spin) {
            // Spinning: look at the box every round, at the socket every few.
            if (box_waiting_ && round % 16 != 0) {
                cpu_relax();
                continue;
            }
            if (!socket_.readable()) {
                cpu_relax();
                continue;
            }
            w = socket_.receive_once(message, 0);
        } else if (box_waiting_ && !told_asleep) {
            // A Reply in the box wakes nobody: from now on the worker answers over the socket.
            // Then one more look at the box (it may have answered just now); the fence keeps
            // that look after the store, as the worker stores its answer before it looks here.
            __atomic_store_n(word_at(shm_, staging::kAsleepOffset), box_seq_, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            told_asleep = true;
            continue;
        } else if (box_waiting_) {
            socket_.wait_readable(nap);
            nap = std::min(nap * 2, 250e-6);   // a sleep costs ~60 us more than asked: wake ~3000 times a second
            w = socket_.receive_once(message, 0);
        } else {
            w = socket_.receive_once(message, 100);
        }
        if (w == Socket::Wait::message) {
            if (message.count() == 0) continue;
            if (apply_reply(message.data(0), message.size(0), &message, seq, out, mine)) {
                if (box_waiting_ && (mine.seq == seq || mine.seq == 0)) box_waiting_ = false;   // answered by socket
                return true;
            }
            if (moved_to_.empty()) continue;   // a reply to something else (a call that timed out earlier): keep waiting
        }
        if (ctx_ != 0 && !reattaching_ && (w == Socket::Wait::gone || socket_.lost() || !moved_to_.empty())) {
            // The worker answered, then left (ctxDestroy): read that answer first.
            if ((box_waiting_ && box_answered(&frame, &size)) || socket_.readable()) continue;
            // The worker went away: a server may restore the context from a checkpoint.
            // A call with a timeout (the exit handler's ctxDestroy) looks no longer than that.
            if (!reattach(seq, mine, timeout >= 0 ? std::max(0.0, timeout - seconds_since(start)) : -1)) return false;
            if (seq == 0) {   // a connection call (connection_call), which is not resent: no answer comes
                mine = failure(kUnknown, "the worker went away before it answered");
                return false;
            }
            round = 0;
            nap = 20e-6;
            continue;
        }
        if (w == Socket::Wait::gone) {
            std::string text = "the phos server at " + endpoint() + " went away" +
                               (socket_.error().empty() ? "" : ": " + socket_.error());
            if (!said_gone_) log_error("%s", text.c_str());   // once: every later call fails the same way
            said_gone_ = true;
            kept_.clear();
            box_waiting_ = false;
            mine = failure(kContextIsDestroyed, text);
            return false;
        }
        if (timeout >= 0 && seconds_since(start) > timeout) {
            char text[256];
            snprintf(text, sizeof text, "no phos server answered at %s within %g s", endpoint().c_str(), timeout);
            mine = failure(kNoDevice, text);
            return false;
        }
    }
}

// Waits for a staged chunk's Reply; its failure goes to the next synchronous call.
void Connection::collect(uint64_t seq) {
    if (!kept_.count(seq)) return;
    wire::Result r;
    wait_for(seq, nullptr, -1, r);
    kept_.erase(seq);
    defer(r);
}

void Connection::collect_all() {
    while (!kept_.empty()) collect(*kept_.begin());
}

wire::Result Connection::call(wire::Call call, const HostDestination* out, double timeout) {
    struct Waited {     // counted however the call ends
        std::pair<uint64_t, double>& into;
        Clock::time_point since = Clock::now();
        ~Waited() {
            into.first++;
            into.second += seconds_since(since);
        }
    } waited{waits_[static_cast<int>(call.kind)]};
    if (!dead_.empty()) return failure(kContextIsDestroyed, dead_);
    if (!socket_.ok()) return failure(kNoDevice, socket_.error());
    if (recovery_) bound_log();   // the recovery log grows with synchronous calls too
    if (deferred_status_ != 0) {
        // The server already reported this failure: report it now, and like the server
        // would, do not run the call.
        send_batch(false);
        return take_deferred();
    }
    call.seq = next_seq_++;
    const uint64_t seq = call.seq;
    batch_.push_back(std::move(call));
    if (!send_batch(true, true)) return failure(kContextIsDestroyed, "cannot send to " + endpoint() + ": " + socket_.error());
    wire::Result mine;
    if (!wait_for(seq, out, timeout, mine)) return mine;
    // Staged chunks sent before were answered first, over the socket; a Reply from the
    // mailbox can overtake theirs. Their failure is this call's.
    collect_all();
    if (mine.status == 0 && deferred_status_ != 0) return take_deferred();
    return mine;
}

// -- the shared staging area -----------------------------------------------------------

static bool may_share_host(const std::string& endpoint) {
    const int mode = settings().staging;
    if (mode == 0) return false;
    if (mode == 1) return true;
    return endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("tcp://127.", 0) == 0;
}

static bool random_bytes(void* out, size_t n) {
    char* p = static_cast<char*>(out);
    while (n > 0) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += got;
        n -= static_cast<size_t>(got);
    }
    return true;
}

// A new file a worker is to open, of `size` bytes, and the random cookie its first bytes hold,
// which shows the worker whose file it is: a memfd, sealed against shrinking and growing, which no other
// process can open by name and which goes with its last user, so nothing is left behind if we
// are killed. The seal is what lets a worker map it safely: a file cut short under its mapping
// would kill the worker (SIGBUS). Its name for the worker is /proc/<our pid>/fd/<fd>, valid while
// the descriptor is open. allocate: its bytes are allocated now (the application's own memory:
// a write into a sparse file that memory cannot hold would kill us), else as they are used (a
// staging area, of which copies use what they need). -1 if it cannot be made (errno says why).
static int create_shared_file(size_t size, bool allocate, std::string& path, std::string& cookie) {
    unsigned char c[staging::kCookieBytes];
    if (!random_bytes(c, sizeof c)) return -1;
    const int fd = static_cast<int>(syscall(SYS_memfd_create, "phos", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (fd < 0) return -1;
    int err = ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : errno;
    if (!err && allocate) err = posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (!err && pwrite(fd, c, sizeof c, 0) != static_cast<ssize_t>(sizeof c)) err = errno ? errno : EIO;
    if (!err && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) err = errno;
    if (err) {
        close(fd);
        errno = err;
        return -1;
    }
    cookie.assign(reinterpret_cast<char*>(c), sizeof c);
    path = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
    return fd;
}

// Creates the staging file (create_shared_file), mapped. Its descriptor (fd) names it until the
// worker answered.
static char* create_staging(std::string& path, std::string& cookie, int& fd) {
    fd = create_shared_file(staging::kAreaSize, false, path, cookie);
    if (fd < 0) {
        log_verbose("cannot create a staging area: %s", strerror(errno));
        return nullptr;
    }
    void* area = mmap(nullptr, staging::kAreaSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (area == MAP_FAILED) {
        log_verbose("cannot map a staging area: %s", strerror(errno));
        close(fd);
        return nullptr;
    }
    return static_cast<char*>(area);
}

wire::Result Connection::attach(uint64_t ctx, std::string token, double timeout) {
    const std::string c_token = token;
    std::string path, cookie;
    int fd = -1;
    char* area = may_share_host(endpoint()) ? create_staging(path, cookie, fd) : nullptr;
    wire::Call c = area ? wire::Call::attach_with_staging(ctx, std::move(token), path, cookie, staging::kAreaSize)
                        : wire::Call::attach(ctx, std::move(token));
    wire::Result r = call(std::move(c), nullptr, timeout);
    if (r.status == 0 && !r.u64s.empty()) {   // what a re-attach presents
        ctx_ = r.u64s[0];
        token_ = c_token;
        note_attach(r);
    }
    if (area) {
        close(fd);   // mapped by both or by us alone: the name is no longer needed
        if (r.status == 0 && r.u64s.size() > 1 && r.u64s[1] == 1) {
            shm_ = area;
            const int mode = settings().mailbox;
            const long threads = settings().copy_threads;
            log_verbose("%s: the worker mapped the staging area (mailbox %s, spin %g us, host copies on %ld thread%s)",
                        endpoint().c_str(), mode == 1 ? "always" : mode == 0 ? "off" : "while both spin",
                        settings().spin * 1e6, threads, threads == 1 ? "" : "s");
        } else {
            munmap(area, staging::kAreaSize);
            log_verbose("%s: the worker did not map the staging area: copies travel in frames", endpoint().c_str());
        }
    }
    return r;
}

// -- pinned host memory the worker maps (schema/phos.capnp, "Pinned host memory") ---------

// Where memory the device uses in place is placed (SharedHost::make with in_place): a worker
// maps it at the same address, which must be free there too. Linux places a process's own
// mappings near the top of the user space (0x7f...) and its heap low (0x55...); phos's device
// range starts at 0x600000000000. So this terabyte, below both, is as free in a worker as here.
static constexpr uint64_t kInPlaceBase = 0x300000000000ull, kInPlaceSpan = 1ull << 40;

static void* map_in_place_area(int fd, size_t n) {
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
    const uint64_t step = 2u << 20, span = n + step <= kInPlaceSpan ? kInPlaceSpan - n : 0;
    for (int attempt = 0; attempt < 16 && span; attempt++) {
        uint64_t r = 0;
        if (getrandom(&r, sizeof r, 0) != sizeof r) r = static_cast<uint64_t>(getpid()) * 7919 + attempt;
        void* want = reinterpret_cast<void*>(kInPlaceBase + (r % (span / step)) * step);
        void* got = mmap(want, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd,
                         static_cast<off_t>(kPinnedHeader));
        if (got == want) return got;
        if (got != MAP_FAILED) munmap(got, n);   // a kernel older than 4.17 took the address as a hint
    }
    return MAP_FAILED;
}

// hostMap's id of a new shared range: unique in the process, never 0.
static uint64_t next_host_id() {
    static uint64_t next = 1;   // under the driver's lock, as every call
    return next++;
}

std::unique_ptr<SharedHost> SharedHost::make(size_t n, bool in_place) {
    std::unique_ptr<SharedHost> h(new SharedHost());
    h->fd_ = create_shared_file(kPinnedHeader + n, true, h->path_, h->cookie_);
    void* data = MAP_FAILED;
    if (h->fd_ >= 0) {
        data = in_place ? map_in_place_area(h->fd_, n)
                        : mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd_, static_cast<off_t>(kPinnedHeader));
        if (data == MAP_FAILED && !errno) errno = EEXIST;
    }
    if (data == MAP_FAILED) {
        log_verbose("cannot make %zu bytes of pinned host memory shared (%s): it stays private", n, strerror(errno));
        return nullptr;   // the destructor closes the file
    }
    h->data_ = static_cast<char*>(data);
    h->size_ = n;
    h->id_ = next_host_id();
    return h;
}

// Whether every page of [start, end) is private anonymous memory we may write (heap, stack,
// an anonymous mmap): only such pages keep their meaning when a shared file is mapped over them.
// A file's pages or a shared mapping would be cut from their file and their other processes.
static bool private_anonymous(uintptr_t start, uintptr_t end, std::string& why) {
    FILE* maps = fopen("/proc/self/maps", "r");
    if (!maps) {
        why = std::string("cannot read /proc/self/maps: ") + strerror(errno);
        return false;
    }
    char line[512];
    uintptr_t covered = start;
    while (covered < end && fgets(line, sizeof line, maps)) {
        line[strcspn(line, "\n")] = 0;
        unsigned long lo, hi, inode;
        char perms[8] = {}, path[256] = {};
        if (sscanf(line, "%lx-%lx %7s %*s %*s %lu %255[^\n]", &lo, &hi, perms, &inode, path) < 4) continue;
        if (hi <= covered || lo > covered) continue;      // mappings are listed in address order
        const char* name = path + strspn(path, " ");
        const bool anonymous = inode == 0 && (!*name || !strcmp(name, "[heap]") || !strcmp(name, "[stack]") ||
                                              !strncmp(name, "[anon:", 6));
        if (strncmp(perms, "rw", 2) != 0 || perms[3] != 'p' || !anonymous) {
            why = std::string("its pages are ") +
                  (perms[3] != 'p' ? "a shared mapping" : !anonymous ? "a file's" : "not writable") + " (" + line +
                  "): only private anonymous memory (malloc, new, an anonymous mmap) can be shared with the device's process";
            fclose(maps);
            return false;
        }
        covered = hi;
    }
    fclose(maps);
    if (covered < end) why = "part of its pages is not mapped";
    return covered >= end;
}

std::unique_ptr<SharedHost> SharedHost::adopt(void* p, size_t n, std::string& why) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t start = reinterpret_cast<uintptr_t>(p) / page * page;
    const size_t size = (reinterpret_cast<uintptr_t>(p) + n + page - 1) / page * page - start;
    if (!private_anonymous(start, start + size, why)) return nullptr;
    std::unique_ptr<SharedHost> h(new SharedHost());
    h->fd_ = create_shared_file(kPinnedHeader + size, true, h->path_, h->cookie_);
    if (h->fd_ < 0) {
        why = std::string("cannot make a shared file of ") + std::to_string(size) + " bytes: " + strerror(errno);
        return nullptr;
    }
    // The bytes, then the file's mapping over them: a write another thread makes to these pages
    // in between is lost, as CUDA's registration is made before the memory's use, not during it.
    char* at = reinterpret_cast<char*>(start);
    for (size_t done = 0; done < size;) {
        const ssize_t wrote = pwrite(h->fd_, at + done, size - done, static_cast<off_t>(kPinnedHeader + done));
        if (wrote <= 0) {
            why = std::string("cannot read the pages of ") + std::to_string(n) + " bytes at " +
                  std::to_string(reinterpret_cast<uintptr_t>(p)) + ": " + strerror(wrote < 0 ? errno : EIO);
            return nullptr;
        }
        done += static_cast<size_t>(wrote);
    }
    void* got = mmap(at, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd_, static_cast<off_t>(kPinnedHeader));
    if (got != at) {
        why = std::string("cannot map a shared file over the pages: ") + strerror(errno);
        return nullptr;
    }
    h->data_ = at;
    h->size_ = size;
    h->id_ = next_host_id();
    h->adopted_ = true;
    return h;
}

SharedHost::~SharedHost() {
    if (data_ && adopted_) {
        // Private pages again, holding the bytes: the application still owns this memory (it
        // frees it as it allocated it), and a child it forks must get a copy, not a share.
        void* copy = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (copy != MAP_FAILED) {
            memcpy(copy, data_, size_);
            if (mremap(copy, size_, size_, MREMAP_MAYMOVE | MREMAP_FIXED, data_) == MAP_FAILED) munmap(copy, size_);
        }   // else the pages stay the file's: still the application's bytes
    } else if (data_) {
        munmap(data_, size_);
    }
    if (fd_ >= 0) close(fd_);
}

// A call about this connection rather than the context (hostMap, hostUnmap): after the calls
// queued before it, alone, with seq 0; it is not logged, and so never resent.
wire::Result Connection::connection_call(wire::Call c, bool flush) {
    if (!dead_.empty()) return failure(kContextIsDestroyed, dead_);
    if (flush) send_batch(false);
    c.seq = 0;
    const wire::Call* calls[1] = {&c};
    std::string frame;
    wire::encode_request(calls, 1, true, frame);
    socket_requests_++;
    if (!socket_.send(frame, {})) return failure(kContextIsDestroyed, "cannot send to " + endpoint() + ": " + socket_.error());
    wire::Result r;
    wait_for(0, nullptr, -1, r);
    return r;
}

bool Connection::shares_host(const SharedHost& h) {
    if (!shm_) return false;   // a worker that did not map our staging area shares no host with us
    auto known = host_ranges_.find(h.id());
    return known != host_ranges_.end() ? known->second : announce_host(h);
}

// hostMap. The answer is kept (a refusal too: the range's copies then travel as others do);
// a call that failed (the worker went away as it was asked, say) is asked again at next use.
bool Connection::announce_host(const SharedHost& h) {
    wire::Result r = connection_call(wire::Call::host_map(h.id(), h.path(), h.cookie(), h.size()));
    const bool mapped = r.status == 0 && !r.u64s.empty() && r.u64s[0] == 1;
    if (r.status == 0) host_ranges_[h.id()] = mapped;
    if (mapped)
        log_verbose("%s: the worker mapped pinned host memory %p (%zu bytes): copies from and to it travel as references",
                    endpoint().c_str(), static_cast<void*>(h.data()), h.size());
    else
        log_verbose("%s: the worker did not map pinned host memory %p (%s): copies from and to it travel as others do",
                    endpoint().c_str(), static_cast<void*>(h.data()), (r.status ? r.message : r.text).c_str());
    return mapped;
}

bool Connection::map_in_place(const SharedHost& h, std::string& why) {
    if (!shm_) {
        why = "the worker of this context does not share this host (it did not map the staging area)";
        return false;
    }
    InPlace r{h.id(), h.size(), reinterpret_cast<uint64_t>(h.data()), h.path(), h.cookie()};
    if (!announce_in_place(r, why)) return false;
    host_ranges_[h.id()] = true;
    in_place_.push_back(std::move(r));
    return true;
}

bool Connection::announce_in_place(const InPlace& r, std::string& why) {
    wire::Result res = connection_call(wire::Call::host_map(r.id, r.path, r.cookie, r.size, r.address), !reattaching_);
    if (res.status == 0 && !res.u64s.empty() && res.u64s[0] == 1) {
        log_verbose("%s: the worker mapped %zu bytes at %#llx for the device to use in place", endpoint().c_str(),
                    static_cast<size_t>(r.size), static_cast<unsigned long long>(r.address));
        return true;
    }
    why = res.status ? res.message : res.text;
    return false;
}

void Connection::forget_host(const SharedHost& h) {
    in_place_.erase(std::remove_if(in_place_.begin(), in_place_.end(), [&](const InPlace& r) { return r.id == h.id(); }),
                    in_place_.end());
    auto known = host_ranges_.find(h.id());
    if (known == host_ranges_.end()) return;
    const bool mapped = known->second;
    host_ranges_.erase(known);
    if (!mapped) return;
    wire::Result r = connection_call(wire::Call::host_unmap(h.id()));
    if (r.status != 0) log_verbose("%s: hostUnmap: %s", endpoint().c_str(), r.message.c_str());
}

// A memcpyPinned resent (resend_after) travels in frames; device->host, it writes its bytes back
// where the application expects them, unless it was answered before (they were there, and the
// application may have written since).
void Connection::resend_unpinned(wire::Call& c) {
    if (!(c.flags & wire::Call::kToDevice)) {
        if (c.seq <= answered_) {
            c = as_nothing(c);
            return;
        }
        write_backs_[c.seq] = HostDestination{reinterpret_cast<void*>(c.address2), c.size};
    }
    unpin(c);
}

// What attach said about recovery (schema/phos.capnp, "Recovery"): u64s[3] = 1 when the
// worker takes recovery images, text = its server's standby ("" for none).
void Connection::note_attach(const wire::Result& r) {
    recovery_ = r.u64s.size() > 3 && r.u64s[3] == 1;
    if (!r.text.empty()) standby_ = r.text;   // a standby without one of its own: keep the old
    if (recovery_)
        log_verbose("%s: recovery images on (standby: %s)", endpoint().c_str(), standby_.empty() ? "none" : standby_.c_str());
}

void Connection::copy_to_device_staged(uint64_t dst, const void* src, size_t n, uint64_t stream) {
    const char* from = static_cast<const char*>(src);
    for (size_t done = 0; done < n;) {
        const size_t size = std::min(staging::kSlotSize, n - done);
        const unsigned i = next_slot_;
        next_slot_ ^= 1;
        collect(slot_seq_[i]);   // the worker is done with this slot
        if (!dead_.empty()) return;   // the failure goes to the next synchronous call
        if (!shm_) {   // re-attached to a worker that did not map a staging area: the rest in a frame
            post(wire::Call::memcpy_htod(dst + done, stream, wire::Payload::copy_of(from + done, n - done), false));
            return;
        }
        const size_t offset = staging::kSlotsOffset + i * staging::kSlotSize;
        copy_bulk(shm_ + offset, from + done, size);   // on several threads: one core's memcpy is the bound
        const uint64_t seq = send_now(wire::Call::memcpy_htod_staged(dst + done, size, stream, offset, done, n));
        kept_.insert(seq);
        slot_seq_[i] = seq;
        staged_bytes_ += size;
        done += size;
    }
}

wire::Result Connection::copy_from_device_staged(void* dst, uint64_t src, size_t n, uint64_t stream) {
    if (!dead_.empty()) return failure(kContextIsDestroyed, dead_);
    if (!socket_.ok()) return failure(kNoDevice, socket_.error());
    if (deferred_status_ != 0) {
        send_batch(false);
        return take_deferred();
    }
    char* to = static_cast<char*>(dst);
    const size_t chunks = (n + staging::kSlotSize - 1) / staging::kSlotSize;
    struct InFlight {
        uint64_t seq;
        size_t chunk;
        const char* area;   // the staging area it was sent with (a re-attach may bring another; null: none)
    };
    std::deque<InFlight> inflight;
    auto issue = [&](size_t k) {
        const unsigned i = static_cast<unsigned>(k % 2);
        collect(slot_seq_[i]);
        slot_seq_[i] = 0;
        const size_t begin = k * staging::kSlotSize;
        const size_t size = std::min(staging::kSlotSize, n - begin);
        const size_t offset = staging::kSlotsOffset + i * staging::kSlotSize;
        if (!shm_) {   // re-attached to a worker that did not map a staging area: a plain copy
            const uint64_t seq = send_now(wire::Call::memcpy_dtoh(src + begin, size, stream, false));
            write_backs_[seq] = HostDestination{to + begin, size};
            inflight.push_back({seq, k, nullptr});
            return;
        }
        inflight.push_back(
            {send_now(wire::Call::memcpy_dtoh_staged(src + begin, size, stream, offset, begin, n)), k, shm_});
    };
    for (size_t k = 0; k < std::min<size_t>(2, chunks); k++) issue(k);
    wire::Result result;
    bool failed = false;
    while (!inflight.empty()) {
        const InFlight f = inflight.front();
        inflight.pop_front();
        wire::Result r;
        if (!wait_for(f.seq, nullptr, -1, r)) return r;   // the server is gone
        if (r.status != 0) {
            if (!failed) result = std::move(r);
            failed = true;
        } else if (!failed && f.area) {
            const size_t begin = f.chunk * staging::kSlotSize;
            const size_t size = std::min(staging::kSlotSize, n - begin);
            copy_bulk(to + begin, f.area + staging::kSlotsOffset + (f.chunk % 2) * staging::kSlotSize, size);
            staged_bytes_ += size;
        }
        if (!failed && f.chunk + 2 < chunks) issue(f.chunk + 2);
    }
    if (!failed && deferred_status_ != 0) return take_deferred();
    return result;
}

// -- re-attaching to a restored context ------------------------------------------------

// The worker went away while we wait for `seq`. Finds where the context lives now (a
// server restored it from a checkpoint), attaches there, and resends the calls after the
// image's cut; false, with `mine` saying why, if that cannot be done (schema/phos.capnp,
// "Snapshots"; client_stub/connection.py, Connection.reattach, does the same).
bool Connection::reattach(uint64_t seq, wire::Result& mine, double budget) {
    double limit = settings().reattach_timeout;
    if (budget >= 0) limit = std::min(limit, budget);
    const auto start = Clock::now();
    const std::string old_endpoint = endpoint();
    const bool was_recovering = recovery_;   // the new worker's attach says anew
    const uint64_t floor = log_floor();      // we hold every call after it
    answered_ = acked_;                      // the Results of calls up to it reached us: a resend drops them
    if (!resuming_)
        log_error("the worker of context %llu at %s went away: waiting up to %g s for a server to restore it",
                  (unsigned long long)ctx_, old_endpoint.c_str(), limit);
    reattaching_ = true;
    char* old_area = shm_;
    if (shm_) old_areas_.push_back(shm_);   // a resent copy may still read or fill it
    forget_worker_mappings();
    std::string why = "no answer";
    uint64_t cut = 0;
    bool attached = false, told = false;
    while (true) {
        const double left = limit - seconds_since(start);
        const double timeout = std::max(0.1, std::min(settings().connect_timeout, left));
        std::string endpoint;
        told = !moved_to_.empty();   // the old worker said where, as it retired
        if (told) endpoint.swap(moved_to_);
        else endpoint = find_context(timeout, why);
        if (!endpoint.empty()) {
            attached = attach_again(endpoint, timeout, cut, why);
            if (attached) break;
            passed_over_ = found_at_;   // it handed the context to a server that died since, say
        }
        if (seconds_since(start) >= limit || refused_) break;   // refused: the operator ended it
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!attached) {
        char text[1024];
        snprintf(text, sizeof text,
                 "the worker of context %llu at %s went away and no server restored the context within %g s "
                 "(last answer: %s)",
                 (unsigned long long)ctx_, old_endpoint.c_str(), limit, why.c_str());
        log_error("%s", text);
        give_up(text);
        mine = failure(kContextIsDestroyed, text);
        return false;
    }
    // The image holds every call up to `cut`; we hold every call after `floor`.
    // Device->host bytes of calls up to the cut that never reached us are lost too.
    uint64_t lost = seq != 0 && seq <= cut ? seq : 0;   // a call whose Result never reached us
    for (const auto& w : write_backs_)
        if (w.first <= cut && (lost == 0 || w.first < lost)) lost = w.first;
    if (floor > cut || lost != 0) {
        char text[1024];
        if (floor > cut)
            snprintf(text, sizeof text,
                     "context %llu was restored from an image taken at call %llu, but calls %llu..%llu were already "
                     "%s by the worker that went away and are gone: the context cannot continue",
                     (unsigned long long)ctx_, (unsigned long long)cut, (unsigned long long)cut + 1,
                     (unsigned long long)floor, was_recovering ? "saved in a later recovery image" : "acknowledged");
        else
            snprintf(text, sizeof text,
                     "context %llu was restored from an image taken at call %llu, after call %llu whose results "
                     "never reached us: the context cannot continue",
                     (unsigned long long)ctx_, (unsigned long long)cut, (unsigned long long)lost);
        log_error("%s", text);
        give_up(text);   // nothing more may reach the restored worker: it lacks calls
        mine = failure(kContextIsDestroyed, text);
        return false;
    }
    durable_ = cut;
    for (const InPlace& r : in_place_) {     // before the calls whose kernels use them
        std::string no;
        if (announce_in_place(r, no)) host_ranges_[r.id] = true;
        else log_error("context %llu: memory at %#llx that the device used in place is not mapped by the worker "
                       "it re-attached to (%s): kernels that use it will fault", (unsigned long long)ctx_,
                       static_cast<unsigned long long>(r.address), no.c_str());
    }
    resend_after(cut, old_area);
    reattaching_ = false;   // only now: resending must not stop to bound the log
    (resuming_ ? log_verbose : log_error)("context %llu re-attached at %s%s%s (image cut at call %llu): resent %zu call(s)",
              (unsigned long long)ctx_, endpoint().c_str(), told ? ", told by its old worker" : "",
              attached_ahead_ ? ", connected ahead" : "", (unsigned long long)cut, unacked_calls_);
    return true;
}

// The staging area and pinned ranges belong to the worker we talked to: the next one (found by a
// re-attach) maps a staging area of its own, and the ranges again as they are used (in place
// ones: reattach announces them).
void Connection::forget_worker_mappings() {
    shm_ = nullptr;
    box_waiting_ = false;
    box_seq_ = 0;
    slot_seq_[0] = slot_seq_[1] = 0;
    next_slot_ = 0;
    host_ranges_.clear();
}

bool Connection::lost(std::string& why) const {
    if (dead_.empty() && ctx_ != 0) return false;
    why = dead_.empty() ? "the context never attached" : dead_;
    return true;
}

bool Connection::detach(std::string& why) {
    if (lost(why)) return false;
    wire::Result r = call(wire::Call::plain(wire::Kind::ctxSynchronize));
    if (!dead_.empty()) {   // lost while it drained
        why = dead_;
        return false;
    }
    defer(r);   // the application's next synchronizing call reports it, as it would have
    collect_all();
    socket_.reopen("inproc://phos-detached");   // no descriptor of ours names the worker
    ahead_.reset();
    moved_to_.clear();
    if (shm_) munmap(shm_, staging::kAreaSize);
    for (char* area : old_areas_) munmap(area, staging::kAreaSize);
    old_areas_.clear();
    forget_worker_mappings();
    return true;
}

bool Connection::resume(const std::string& server, std::string& why) {
    if (lost(why)) return false;
    found_at_ = server;   // asked first
    passed_over_.clear();
    refused_ = false;
    resuming_ = true;
    wire::Result mine;
    const bool ok = reattach(0, mine, -1);
    resuming_ = false;
    if (!ok) why = mine.message;
    return ok;
}

// Where does the context live now? Asks the front ends that may know, with
// reattach{ctx, token}: the one that found it last time first, then PHOS_SERVER (read now:
// the context may have moved to another server), then the standby (PHOS_STANDBY, else the
// one attach named); one whose answer led to no worker last time, last. Returns the worker's
// endpoint, or "" with `why`.
std::string Connection::find_context(double timeout, std::string& why) {
    std::vector<std::string> servers;
    for (const std::string& server : {found_at_, server_now(), standby_now(standby_)})
        if (!server.empty() && std::find(servers.begin(), servers.end(), server) == servers.end()) servers.push_back(server);
    auto passed = std::find(servers.begin(), servers.end(), passed_over_);
    if (passed != servers.end()) std::rotate(passed, passed + 1, servers.end());
    std::string whys;
    for (const std::string& server : servers) {
        std::string endpoint = ask_front_end(server, timeout, why);
        if (!endpoint.empty()) {
            found_at_ = server;
            passed_over_.clear();
            return endpoint;
        }
        whys += (whys.empty() ? "" : "; ") + why;
    }
    why = whys;
    return "";
}

// One front end's answer to reattach. One that does not complete the ZeroMQ handshake
// within 2 s (dead: the connection is refused; stopped: it never greets) is passed over,
// so that the standby is asked soon; a live one gets `timeout` to answer (it may restore
// the context first).
std::string Connection::ask_front_end(const std::string& server, double timeout, std::string& why) {
    Connection front(server, false);
    const double quick = std::min(timeout, 2.0);
    const auto start = Clock::now();
    while (front.ok() && !front.socket_.greeted() && seconds_since(start) < quick)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    wire::Result r;
    if (!front.ok()) r = failure(kNoDevice, front.socket_.error());
    else if (!front.socket_.greeted()) r = failure(kNoDevice, "no front end answers at " + server);
    else r = front.call(wire::Call::reattach(ctx_, token_), nullptr, timeout);
    if (r.status == 0 && !r.text.empty()) {
        if (!r.data.empty()) standby_ = r.data;   // handed off: the standby of the server it went to
        return r.text;
    }
    if (r.status == kNotPermitted) refused_ = true;   // killed (`phos ctx kill`): no use waiting
    why = r.message.empty() ? "the front end at " + server + " sent no worker endpoint" : r.message;
    return "";
}

// The context cannot go on: every later call fails with `why`, sending nothing.
void Connection::give_up(const std::string& why) {
    dead_ = why;
    ctx_ = 0;
    reattaching_ = false;
    said_gone_ = true;
    kept_.clear();
    write_backs_.clear();
    batch_.clear();
    unacked_.clear();
    unacked_calls_ = log_bytes_ = borrowed_unacked_ = 0;
    batch_payload_bytes_ = batch_frame_estimate_ = batch_calls_ = 0;
    host_ranges_.clear();
    pinned_seq_ = 0;
    socket_.reopen("inproc://phos-context-lost");   // drops what the old socket still queues
}

// Connects to the restored worker and attaches as seq 0 (it takes no place in the call
// stream), offering a new staging area. `cut`: the last call the worker has executed.
bool Connection::attach_again(const std::string& endpoint, double timeout, uint64_t& cut, std::string& why) {
    attached_ahead_ = ahead_ && ahead_->ok() && ahead_->endpoint() == endpoint;
    if (attached_ahead_) socket_.take(*ahead_);   // its handshake is done
    else socket_.reopen(endpoint);
    ahead_.reset();
    if (!socket_.ok()) {
        why = socket_.error();
        return false;
    }
    std::string path, cookie;
    int fd = -1;
    char* area = may_share_host(endpoint) ? create_staging(path, cookie, fd) : nullptr;
    wire::Call c = area ? wire::Call::attach_with_staging(ctx_, token_, path, cookie, staging::kAreaSize)
                        : wire::Call::attach(ctx_, token_);
    c.seq = 0;
    const wire::Call* calls[1] = {&c};
    std::string frame;
    wire::encode_request(calls, 1, true, frame);
    wire::Result r;
    if (!socket_.send(frame, {})) {
        r = failure(kContextIsDestroyed, "cannot send to " + endpoint + ": " + socket_.error());
    } else if (wait_for(0, nullptr, timeout, r) && r.status == 0 && r.u64s.size() < 3) {
        r = failure(kUnknown, "the worker at " + endpoint + " sent no cut with attach");
    }
    if (area) {
        close(fd);
        if (r.status == 0 && r.u64s.size() > 1 && r.u64s[1] == 1) shm_ = area;
        else munmap(area, staging::kAreaSize);
    }
    if (r.status != 0) {
        why = r.message;
        return false;
    }
    cut = r.u64s[2];
    note_attach(r);
    return true;
}

// Resends the logged calls after `cut` (a launchBatch never straddles it), then the
// pending batch, each Request ending where one ended before, so every call someone waits
// for gets its Result; calls answered before (up to answered_) ask for no Reply, and their
// Results are dropped. Copies that named the old staging area or a pinned range travel in
// frames; a device->host copy into a pinned range answered before is not resent (the
// application may have written there since).
void Connection::resend_after(uint64_t cut, char* old_area) {
    trim_log(cut);
    const uint64_t done = std::max(cut, answered_);   // staged chunks no longer awaited
    for (auto it = kept_.begin(); it != kept_.end();) it = *it <= done ? kept_.erase(it) : std::next(it);
    std::deque<wire::Call> log;
    log.swap(unacked_);
    std::vector<wire::Call> pending;
    pending.swap(batch_);
    unacked_calls_ = log_bytes_ = borrowed_unacked_ = 0;
    batch_payload_bytes_ = batch_frame_estimate_ = batch_calls_ = 0;
    for (auto& c : log) {
        if (c.via_shm() && old_area) {
            if (c.kind == wire::Kind::memcpyDtoH && c.seq > answered_)   // where the waiting copy reads them
                write_backs_[c.seq] = HostDestination{old_area + c.id, c.size};
            unstage(c, old_area);
        }
        if (c.kind == wire::Kind::memcpyPinned) resend_unpinned(c);
        const bool ends = c.ends, wanted = c.wanted && c.seq > answered_;
        batch_.push_back(std::move(c));
        if (ends) send_batch(wanted);
    }
    for (auto& c : pending) {
        if (c.kind == wire::Kind::memcpyPinned) resend_unpinned(c);
        batch_.push_back(std::move(c));
    }
    if (!batch_.empty()) send_batch(true);
}

}  // namespace phos
