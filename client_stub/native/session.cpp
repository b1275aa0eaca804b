#include "session.h"

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

Connection::Connection(const std::string& endpoint, bool batching) : socket_(endpoint), batching_(batching) {
    batch_.reserve(static_cast<size_t>(settings().batch_calls));
}

wire::Result Connection::failure(uint32_t status, std::string message) {
    wire::Result r;
    r.status = status;
    r.message = std::move(message);
    return r;
}

void Connection::post(wire::Call call, const HostDestination* write_back) {
    call.seq = next_seq_++;
    if (write_back) write_backs_[call.seq] = *write_back;
    if (batch_.empty()) batch_started_ = Clock::now();
    batch_payload_bytes_ += call.payload.size;
    batch_frame_estimate_ += 96 + call.text.size() + call.bytes.size();
    batch_.push_back(std::move(call));
    const Settings& s = settings();
    if (!batching_ || batch_.size() >= static_cast<size_t>(s.batch_calls) ||
        batch_payload_bytes_ >= static_cast<size_t>(s.batch_bytes) || batch_frame_estimate_ >= kMaxFrameEstimate ||
        std::chrono::duration<double>(Clock::now() - batch_started_).count() >= s.batch_age) {
        send_batch(false);
    }
}

void Connection::flush_if_stale() {
    if (!batch_.empty() && std::chrono::duration<double>(Clock::now() - batch_started_).count() >= settings().batch_age)
        send_batch(false);
}

bool Connection::send_batch(bool want_reply) {
    if (batch_.empty()) return true;
    std::vector<const wire::Call*> calls;
    std::vector<const wire::Payload*> payloads;
    calls.reserve(batch_.size());
    for (const auto& c : batch_) {
        calls.push_back(&c);
        if (c.has_payload()) payloads.push_back(&c.payload);
    }
    wire::encode_request(calls.data(), calls.size(), want_reply, frame_);
    const bool sent = socket_.send(frame_, payloads);
    if (!sent) log_error("%s: %s", endpoint().c_str(), socket_.error().c_str());
    for (auto& c : batch_) {
        if (c.payload.owned) unacked_owned_bytes_ += c.payload.size;
        if (c.payload.borrowed) borrowed_unacked_++;
        unacked_.push_back(std::move(c));
    }
    batch_.clear();
    batch_payload_bytes_ = batch_frame_estimate_ = 0;
    if (!want_reply) bound_log();
    return sent;
}

// The replay log only shrinks when a Reply acknowledges calls, and asynchronous calls
// get no Reply. If it grows too long, ask for one with a cheap synchronous call.
void Connection::bound_log() {
    const Settings& s = settings();
    if (!batching_ || (unacked_.size() < static_cast<size_t>(s.unacked_calls_max) &&
                       unacked_owned_bytes_ < static_cast<size_t>(s.unacked_bytes_max)))
        return;
    wire::Result r = call(wire::Call::plain(wire::Kind::memGetInfo));
    if (r.status != 0 && deferred_status_ == 0) {
        // An asynchronous call failed; the application hears of it at its next synchronizing call.
        deferred_status_ = r.status;
        deferred_message_ = r.message;
    }
}

void Connection::trim_log(uint64_t ack_seq) {
    while (!unacked_.empty() && unacked_.front().seq <= ack_seq) {
        const wire::Call& c = unacked_.front();
        if (c.payload.owned) unacked_owned_bytes_ -= c.payload.size;
        if (c.payload.borrowed) borrowed_unacked_--;
        unacked_.pop_front();
    }
}

static void copy_payload(Message& message, uint32_t index, const HostDestination& to) {
    if (index == 0 || index >= message.count() || !to.dst) return;
    std::memcpy(to.dst, message.data(index), std::min(to.size, message.size(index)));
}

bool Connection::apply_reply(Message& message, uint64_t want_seq, const HostDestination* out, wire::Result& mine) {
    wire::Reply reply;
    std::string error;
    if (!wire::decode_reply(message.data(0), message.size(0), reply, error)) {
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
            mine = std::move(r);
            found = true;
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

wire::Result Connection::call(wire::Call call, const HostDestination* out, double timeout) {
    if (!socket_.ok()) return failure(kNoDevice, socket_.error());
    if (deferred_status_ != 0) {
        // The server already reported this failure to a probe: report it now, and like the
        // server would, do not run the call.
        send_batch(false);
        wire::Result r = failure(deferred_status_, deferred_message_);
        deferred_status_ = 0;
        deferred_message_.clear();
        return r;
    }
    const wire::Kind kind = call.kind;
    call.seq = next_seq_++;
    const uint64_t seq = call.seq;
    batch_.push_back(std::move(call));
    if (!send_batch(true)) return failure(kContextIsDestroyed, "cannot send to " + endpoint() + ": " + socket_.error());

    Message message;
    while (true) {
        switch (socket_.receive(message, timeout)) {
        case Socket::Wait::timeout: {
            char text[256];
            snprintf(text, sizeof text, "no phos server answered at %s within %g s", endpoint().c_str(), timeout);
            return failure(kNoDevice, text);
        }
        case Socket::Wait::gone: {
            std::string text = "the phos server at " + endpoint() + " went away" +
                               (socket_.error().empty() ? "" : ": " + socket_.error());
            if (!said_gone_) log_error("%s", text.c_str());   // once: every later call fails the same way
            said_gone_ = true;
            return failure(kContextIsDestroyed, text);
        }
        case Socket::Wait::message: {
            wire::Result mine;
            if (message.count() >= 1 && apply_reply(message, seq, out, mine)) return mine;
            break;   // a reply to something else (a call that timed out earlier): keep waiting
        }
        }
        if (message.count() == 0) return failure(kUnknown, std::string("empty reply to ") + wire::kind_name(kind));
    }
}

}  // namespace phos
