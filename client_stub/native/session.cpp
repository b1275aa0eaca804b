#include "session.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common.h"

namespace phos {

using Clock = std::chrono::steady_clock;

// CUresult values this file produces on its own.
constexpr uint32_t kNoDevice = 100;            // CUDA_ERROR_NO_DEVICE
constexpr uint32_t kContextIsDestroyed = 709;  // CUDA_ERROR_CONTEXT_IS_DESTROYED
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
}

wire::Result Connection::failure(uint32_t status, std::string message) {
    wire::Result r;
    r.status = status;
    r.message = std::move(message);
    return r;
}

std::string Connection::stats() const {
    char text[256];
    snprintf(text, sizeof text, "%llu requests through the mailbox, %llu over the socket, %llu doorbells, %llu bytes staged",
             (unsigned long long)box_requests_, (unsigned long long)socket_requests_, (unsigned long long)doorbells_,
             (unsigned long long)staged_bytes_);
    return text;
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
        seconds_since(batch_started_) >= s.batch_age) {
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
    for (auto& c : batch_) {
        if (c.payload.owned) unacked_owned_bytes_ += c.payload.size;
        if (c.payload.borrowed) borrowed_unacked_++;
        unacked_calls_ += c.calls();
        unacked_.push_back(std::move(c));
    }
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

// -- replies ---------------------------------------------------------------------------

// The replay log only shrinks when a Reply acknowledges calls, and asynchronous calls
// get no Reply. If it grows too long, ask for one with a cheap synchronous call.
void Connection::bound_log() {
    const Settings& s = settings();
    if (!batching_ || (unacked_calls_ < static_cast<size_t>(s.unacked_calls_max) &&
                       unacked_owned_bytes_ < static_cast<size_t>(s.unacked_bytes_max)))
        return;
    wire::Result r = call(wire::Call::plain(wire::Kind::memGetInfo));
    if (r.status != 0) defer(r);   // an asynchronous call failed: the next synchronizing call says so
}

void Connection::trim_log(uint64_t ack_seq) {
    while (!unacked_.empty() && unacked_.front().seq <= ack_seq) {
        const wire::Call& c = unacked_.front();
        if (c.payload.owned) unacked_owned_bytes_ -= c.payload.size;
        if (c.payload.borrowed) borrowed_unacked_--;
        unacked_calls_ -= c.calls();
        unacked_.pop_front();
    }
}

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
    std::memcpy(to.dst, message->data(index), std::min(to.size, message->size(index)));
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
    trim_log(reply.ack_seq);
    if (!reply.output.empty()) {   // device-side printf, shown at synchronization as CUDA does
        fwrite(reply.output.data(), 1, reply.output.size(), stdout);
        fflush(stdout);
    }
    bool found = false;
    for (auto& r : reply.results) {
        if (r.seq == want_seq || (r.seq == 0 && r.status != 0)) {   // seq 0: the whole Request was refused
            if (out && r.status == 0) copy_payload(message, r.payload, *out);
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
// Spins for PHOS_SPIN_US first, then sleeps in short, growing waits on the socket
// (a Reply in the box wakes nobody). False, with `mine` saying why, on timeout or loss.
bool Connection::wait_for(uint64_t seq, const HostDestination* out, double timeout, wire::Result& mine) {
    const auto start = Clock::now();
    const double spin = settings().spin;
    double nap = 20e-6;
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
            continue;   // a reply to something else (a call that timed out earlier): keep waiting
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
    if (!socket_.ok()) return failure(kNoDevice, socket_.error());
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

// Creates the staging file: /dev/shm/phos-<pid>-<random>, ours alone (O_EXCL, 0600).
static char* create_staging(std::string& path, std::string& cookie) {
    unsigned char c[staging::kCookieBytes];
    if (!random_bytes(c, sizeof c)) return nullptr;
    cookie.assign(reinterpret_cast<char*>(c), sizeof c);
    char name[64];
    snprintf(name, sizeof name, "/dev/shm/phos-%d-%02x%02x%02x%02x%02x%02x", static_cast<int>(getpid()), c[0], c[1], c[2],
             c[3], c[4], c[5]);
    path = name;
    int fd = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        log_verbose("cannot create a staging area %s: %s", name, strerror(errno));
        return nullptr;
    }
    void* area = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(staging::kAreaSize)) == 0)
        area = mmap(nullptr, staging::kAreaSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int saved = errno;
    close(fd);
    if (area == MAP_FAILED) {
        log_verbose("cannot map a staging area %s: %s", name, strerror(saved));
        unlink(name);
        return nullptr;
    }
    std::memcpy(area, c, sizeof c);
    return static_cast<char*>(area);
}

wire::Result Connection::attach(uint64_t ctx, std::string token, double timeout) {
    std::string path, cookie;
    char* area = may_share_host(endpoint()) ? create_staging(path, cookie) : nullptr;
    wire::Call c = area ? wire::Call::attach_with_staging(ctx, std::move(token), path, cookie, staging::kAreaSize)
                        : wire::Call::attach(ctx, std::move(token));
    wire::Result r = call(std::move(c), nullptr, timeout);
    if (area) {
        unlink(path.c_str());   // mapped by both or by us alone: the name is no longer needed
        if (r.status == 0 && r.u64s.size() > 1 && r.u64s[1] == 1) {
            shm_ = area;
            const int mode = settings().mailbox;
            log_verbose("%s: the worker mapped the staging area (mailbox %s, spin %g us)", endpoint().c_str(),
                        mode == 1 ? "always" : mode == 0 ? "off" : "while both spin",
                        settings().spin * 1e6);
        } else {
            munmap(area, staging::kAreaSize);
            log_verbose("%s: the worker did not map the staging area: copies travel in frames", endpoint().c_str());
        }
    }
    return r;
}

void Connection::copy_to_device_staged(uint64_t dst, const void* src, size_t n, uint64_t stream) {
    const char* from = static_cast<const char*>(src);
    for (size_t done = 0; done < n;) {
        const size_t size = std::min(staging::kSlotSize, n - done);
        const unsigned i = next_slot_;
        next_slot_ ^= 1;
        collect(slot_seq_[i]);   // the worker is done with this slot
        const size_t offset = staging::kSlotsOffset + i * staging::kSlotSize;
        std::memcpy(shm_ + offset, from + done, size);
        const uint64_t seq = send_now(wire::Call::memcpy_htod_staged(dst + done, size, stream, offset, done, n));
        kept_.insert(seq);
        slot_seq_[i] = seq;
        staged_bytes_ += size;
        done += size;
    }
}

wire::Result Connection::copy_from_device_staged(void* dst, uint64_t src, size_t n, uint64_t stream) {
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
    };
    std::deque<InFlight> inflight;
    auto issue = [&](size_t k) {
        const unsigned i = static_cast<unsigned>(k % 2);
        collect(slot_seq_[i]);
        slot_seq_[i] = 0;
        const size_t begin = k * staging::kSlotSize;
        const size_t size = std::min(staging::kSlotSize, n - begin);
        const size_t offset = staging::kSlotsOffset + i * staging::kSlotSize;
        inflight.push_back({send_now(wire::Call::memcpy_dtoh_staged(src + begin, size, stream, offset, begin, n)), k});
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
        } else if (!failed) {
            const size_t begin = f.chunk * staging::kSlotSize;
            const size_t size = std::min(staging::kSlotSize, n - begin);
            std::memcpy(to + begin, shm_ + staging::kSlotsOffset + (f.chunk % 2) * staging::kSlotSize, size);
            staged_bytes_ += size;
        }
        if (!failed && f.chunk + 2 < chunks) issue(f.chunk + 2);
    }
    if (!failed && deferred_status_ != 0) return take_deferred();
    return result;
}

}  // namespace phos
