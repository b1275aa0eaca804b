// The protocol of one connection (schema/phos.capnp, header comment): sequence numbers,
// batching of asynchronous calls, synchronous calls, replies, and the replay log.
//
// Not thread-safe by itself: the driver holds its lock around every use.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport.h"
#include "wire.h"

namespace phos {

// Where the bytes of a device->host copy go once its Result arrives.
struct HostDestination {
    void* dst = nullptr;
    size_t size = 0;
};

class Connection {
public:
    // `batching`: asynchronous calls wait in a batch (context workers); otherwise every
    // call is sent at once (the front end, which only gets synchronous calls).
    Connection(const std::string& endpoint, bool batching);

    const std::string& endpoint() const { return socket_.endpoint(); }
    bool ok() const { return socket_.ok(); }

    // Queues an asynchronous call; its failure is reported by a later synchronous call.
    // `write_back`: for a device->host copy whose bytes arrive with a later Reply.
    void post(wire::Call call, const HostDestination* write_back = nullptr);

    // Runs a synchronous call: sends the batch with it, waits, returns its Result.
    // `out` receives the Result's payload bytes. `timeout` < 0: wait while connected.
    wire::Result call(wire::Call call, const HostDestination* out = nullptr, double timeout = -1);

    // Sends the batch if its first call has waited longer than PHOS_BATCH_AGE_US.
    void flush_if_stale();

    bool has_pending() const { return !batch_.empty() || !write_backs_.empty() || borrowed_unacked_ > 0; }
    size_t unacked() const { return unacked_.size(); }

private:
    bool send_batch(bool want_reply);
    bool apply_reply(Message& message, uint64_t want_seq, const HostDestination* out, wire::Result& mine);
    void trim_log(uint64_t ack_seq);
    void bound_log();
    static wire::Result failure(uint32_t status, std::string message);

    Socket socket_;
    bool batching_;
    uint64_t next_seq_ = 1;
    std::vector<wire::Call> batch_;
    size_t batch_payload_bytes_ = 0;
    size_t batch_frame_estimate_ = 0;
    std::chrono::steady_clock::time_point batch_started_;
    std::deque<wire::Call> unacked_;                    // sent, not yet acknowledged: for replay
    size_t unacked_owned_bytes_ = 0;
    size_t borrowed_unacked_ = 0;                       // unacknowledged calls borrowing caller memory
    std::unordered_map<uint64_t, HostDestination> write_backs_;   // seq -> destination
    uint32_t deferred_status_ = 0;                      // an asynchronous failure seen by a probe
    std::string deferred_message_;
    std::string frame_;                                 // reused encoding buffer
    bool said_gone_ = false;
};

}  // namespace phos
