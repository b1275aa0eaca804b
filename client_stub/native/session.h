// The protocol of one connection (schema/phos.capnp, header comment): sequence numbers,
// batching of asynchronous calls, synchronous calls, replies, the replay log, and the
// shared staging area (bulk copies and the mailbox) when the worker shares our host.
//
// Not thread-safe by itself: the driver holds its lock around every use.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport.h"
#include "wire.h"

namespace phos {

// The shared staging area's layout is schema/phos.capnp's (session.cpp, namespace staging);
// copies smaller than this travel in frames.
namespace staging {
extern const size_t kMinCopy;
}  // namespace staging

// Pinned host memory shared with the workers on our host (schema/phos.capnp, "Pinned host
// memory"): a sealed memfd, made as the staging file is (session.cpp, create_shared_file), which
// the application's bytes are mapped from and a worker maps too, so that copies from and to it
// travel as references (memcpyPinned). Its descriptor stays open while it is allocated, so that
// every worker of ours (one re-attached to included) can map it by name; nothing outlives us.
class SharedHost {
public:
    // `n` bytes of it, or null (saying why with PHOS_VERBOSE) if memory cannot hold them.
    // in_place: placed where the same address is likely free in a worker too (session.cpp).
    static std::unique_ptr<SharedHost> make(size_t n, bool in_place = false);
    // The application's own pages [p, p + n), made shared where they are (cuMemHostRegister with
    // DEVICEMAP): their bytes go into a new file, mapped over them at the same address; until
    // then null, saying why (why). Its destruction gives the pages back private, bytes kept.
    static std::unique_ptr<SharedHost> adopt(void* p, size_t n, std::string& why);
    ~SharedHost();
    SharedHost(const SharedHost&) = delete;
    SharedHost& operator=(const SharedHost&) = delete;

    uint64_t id() const { return id_; }                 // hostMap's: unique in the process, never 0
    const std::string& path() const { return path_; }
    const std::string& cookie() const { return cookie_; }
    char* data() const { return data_; }
    size_t size() const { return size_; }

private:
    SharedHost() = default;
    uint64_t id_ = 0;
    std::string path_;
    std::string cookie_;      // the random bytes its header starts with; the application does not map them
    char* data_ = nullptr;    // the application's bytes, after the header
    size_t size_ = 0;
    int fd_ = -1;             // its memfd, open while it lives: path_ names it to every worker of ours
    bool adopted_ = false;    // the application's own pages (adopt): never unmapped, made private again
};

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
    ~Connection();
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    const std::string& endpoint() const { return socket_.endpoint(); }
    bool ok() const { return socket_.ok(); }

    // The first call to a context worker. Offers a shared staging area when the worker
    // may share our host (ipc://, tcp://127.x, or PHOS_STAGING=1; never with PHOS_STAGING=0);
    // the file is unlinked as soon as the worker answered, whatever it answered.
    wire::Result attach(uint64_t ctx, std::string token, double timeout);
    // A context's connection (once attach succeeded) whose worker goes away looks for the
    // context again: a server may have restored it from a checkpoint, anywhere. For up to
    // PHOS_REATTACH_TIMEOUT seconds (default 60) it asks the front ends that may hold it
    // (PHOS_SERVER, read then, and the standby: find_context) with reattach{ctx, token},
    // attaches to the new worker, and resends the calls the image lacks (schema/phos.capnp,
    // "Snapshots" and "Recovery"). Calls after the image's cut that are no longer logged
    // are lost: then the waiting call fails, saying so.
    bool reattachable() const { return ctx_ != 0; }
    // The worker mapped the staging area: bulk copies and the mailbox use it.
    bool staging() const { return shm_ != nullptr; }

    // Queues an asynchronous call; its failure is reported by a later synchronous call.
    // `write_back`: for a device->host copy whose bytes arrive with a later Reply.
    void post(wire::Call call, const HostDestination* write_back = nullptr);

    // Runs a synchronous call: sends the batch with it, waits, returns its Result.
    // `out` receives the Result's payload bytes. `timeout` < 0: wait while connected.
    wire::Result call(wire::Call call, const HostDestination* out = nullptr, double timeout = -1);

    // Bulk copies through the staging area (only when staging()), in slot-sized chunks.
    // Host->device returns once `src` may be reused; a failure is reported by the next
    // synchronous call. Device->host waits for the bytes and returns the copy's Result.
    void copy_to_device_staged(uint64_t dst, const void* src, size_t n, uint64_t stream);
    wire::Result copy_from_device_staged(void* dst, uint64_t src, size_t n, uint64_t stream);

    // Whether the worker maps pinned range `h`: copies from and to it are then memcpyPinned.
    // The first time, it is asked (hostMap), if it maps our staging area: one that does not
    // shares no host with us.
    bool shares_host(const SharedHost& h);
    // Range `h` goes away: a worker that maps it unmaps it, after the device's work (hostUnmap).
    void forget_host(const SharedHost& h);
    // Has the worker map range `h` (made in_place) at our address of it, for the device to read
    // and write in place (hostMap with its address); false with `why` if it cannot.
    bool map_in_place(const SharedHost& h, std::string& why);

    // A whole-process checkpoint (agent.cpp, docs/DESIGN.md "Whole applications"): detach()
    // sends every queued call and waits until the worker answered them all, so that no call is in
    // flight at the cut and no Reply waits unread, then closes the socket and unmaps the staging
    // area, keeping what resume() needs; an asynchronous failure it collects stays for the next
    // synchronizing call. resume() attaches again through the front end at `server` (the same
    // worker, or one that restored the context's image anywhere). False with `why` if the
    // context is lost.
    bool detach(std::string& why);
    bool resume(const std::string& server, std::string& why);
    uint64_t context_id() const { return ctx_; }
    // The front end that last found the context ("" for the one it was made on).
    const std::string& found_at() const { return found_at_; }

    // Sends the batch if its first call has waited longer than PHOS_BATCH_AGE_US.
    void flush_if_stale();

    // The seq of the call sent last (a synchronous call's, right after it returns).
    uint64_t last_seq() const { return next_seq_ - 1; }
    // A logged call that must change nothing when the log is replayed: a module image named
    // by its digest that the server did not keep (the image followed in a call of its own).
    void replay_as_nothing(uint64_t seq);

    bool has_pending() const {
        return !batch_.empty() || !write_backs_.empty() || borrowed_unacked_ > 0 || pinned_seq_ > acked_;
    }
    size_t unacked() const { return unacked_calls_; }
    // "N requests through the mailbox, M over the socket, ..." (for PHOS_VERBOSE).
    std::string stats() const;

private:
    bool send_batch(bool want_reply, bool use_box = false);
    bool send_socket(size_t begin, size_t end, bool want_reply);
    bool boxable(const wire::Call& c) const;
    bool use_mailbox() const;
    void post_to_box();
    bool box_answered(const char** frame, size_t* size);
    uint64_t send_now(wire::Call call);
    // flush: send the queued calls first (not while a re-attach has calls to resend before them)
    wire::Result connection_call(wire::Call call, bool flush = true);
    bool announce_host(const SharedHost& h);
    bool wait_for(uint64_t seq, const HostDestination* out, double timeout, wire::Result& mine);
    bool apply_reply(const void* frame, size_t size, Message* message, uint64_t want_seq, const HostDestination* out,
                     wire::Result& mine);
    void collect(uint64_t seq);
    void collect_all();
    void defer(const wire::Result& r);
    wire::Result take_deferred();
    void trim_log(uint64_t seq);
    uint64_t log_floor() const { return recovery_ ? durable_ : acked_; }   // we hold every call after it
    void advance(uint64_t ack, uint64_t durable);
    void note_attach(const wire::Result& r);
    void log_call(wire::Call c);
    bool reattach(uint64_t seq, wire::Result& mine, double budget);
    std::string find_context(double timeout, std::string& why);
    std::string ask_front_end(const std::string& server, double timeout, std::string& why);
    bool attach_again(const std::string& endpoint, double timeout, uint64_t& cut, std::string& why);
    void resend_after(uint64_t cut, char* old_area);
    void resend_unpinned(wire::Call& c);
    void give_up(const std::string& why);
    void forget_worker_mappings();
    bool lost(std::string& why) const;   // the context is gone (or never attached): why
    bool log_full() const;
    void bound_log();
    void wait_for_image();
    static wire::Result failure(uint32_t status, std::string message);

    Socket socket_;
    bool batching_;
    uint64_t next_seq_ = 1;
    std::vector<wire::Call> batch_;
    size_t batch_payload_bytes_ = 0;
    size_t batch_frame_estimate_ = 0;
    size_t batch_calls_ = 0;                            // calls in batch_, each launch of a launchBatch counted
    std::chrono::steady_clock::time_point batch_started_;
    static constexpr double kRampAge = 50e-6;           // seconds: see send_batch
    double batch_age_ = kRampAge;                       // seconds a batch waits at most: short after a call
                                                        // that waited for the device (see post)
    std::deque<wire::Call> unacked_;                    // sent, for replay: not yet acknowledged (with
                                                        // recovery: after the latest image's cut)
    size_t unacked_calls_ = 0;                          // the calls they stand for (Call::calls)
    size_t log_bytes_ = 0;                              // the host bytes they hold (held_bytes)
    size_t borrowed_unacked_ = 0;                       // unacknowledged calls borrowing caller memory
    std::unordered_map<uint64_t, HostDestination> write_backs_;   // seq -> destination
    uint32_t deferred_status_ = 0;                      // an asynchronous failure the server already reported
    std::string deferred_message_;
    std::string frame_;                                 // reused encoding buffer
    bool said_gone_ = false;

    // Re-attaching (reattach()): the context and session token attach presented, the
    // highest seq a worker acknowledged (without recovery we hold every call after it),
    // and staging areas of workers gone by, kept mapped while a resent copy may still use them.
    uint64_t ctx_ = 0;
    std::string token_;
    uint64_t acked_ = 0;
    uint64_t answered_ = 0;                             // acked_ when the worker went away: the Results
                                                        // of resent calls up to it are dropped
    bool reattaching_ = false;
    bool resuming_ = false;                             // resume() runs the re-attach: nothing went away
    bool refused_ = false;          // a front end refused to find the context for good (it was killed)
    // Recovery (schema/phos.capnp, "Recovery"), as the last attach said.
    bool recovery_ = false;
    uint64_t durable_ = 0;                              // calls up to it are in the latest image
    std::string standby_;                               // the standby server ("" none)
    std::string found_at_;                              // the front end that last found the context
    std::string passed_over_;                           // ...where it pointed, nobody answered: asked last
    std::string moved_to_;                              // where a retiring worker said the context went
    std::unique_ptr<Socket> ahead_;                     // connected ahead to where a handoff moves it (Reply.movingTo)
    bool attached_ahead_ = false;                       // the last re-attach used it
    bool bounding_ = false;                             // bound_log is waiting for an image
    std::vector<char*> old_areas_;
    std::string dead_;                                  // why the context is lost, once it is

    // The shared staging area, once the worker mapped it.
    char* shm_ = nullptr;
    uint64_t slot_seq_[2] = {0, 0};                     // the staged host->device chunk last in each slot
    unsigned next_slot_ = 0;
    std::unordered_set<uint64_t> kept_;                 // staged host->device chunks not yet answered
    uint64_t box_seq_ = 0;                              // our last mailbox request
    bool box_waiting_ = false;                          // ... whose Reply has not come yet
    std::string bell_;                                  // the doorbell Request, encoded once
    uint64_t box_requests_ = 0, socket_requests_ = 0, doorbells_ = 0, staged_bytes_ = 0;
    // The synchronous calls by kind: how many, and the seconds the application waited for
    // them (stats() names those that cost most: where a slow program waits on the server).
    std::unordered_map<int, std::pair<uint64_t, double>> waits_;

    // Pinned ranges this worker was asked about (shares_host): id -> whether it maps them.
    std::unordered_map<uint64_t, bool> host_ranges_;
    // Ranges the device reads and writes in place (map_in_place), announced again to a worker
    // found after a re-attach, since kernels use them without a copy that would announce them.
    struct InPlace {
        uint64_t id, size, address;
        std::string path, cookie;
    };
    std::vector<InPlace> in_place_;
    bool announce_in_place(const InPlace& r, std::string& why);
    uint64_t pinned_seq_ = 0;                           // the last memcpyPinned sent: pending until acknowledged
    uint64_t pinned_bytes_ = 0;                         // bytes copied in place (stats)
};

}  // namespace phos
