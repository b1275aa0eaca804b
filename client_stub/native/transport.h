// ZeroMQ transport: one DEALER socket to a front end or a context worker.
//
// libzmq is linked statically with hidden symbols, so an application's own libzmq
// (pyzmq's, say) and ours never see each other.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <zmq.h>

#include "wire.h"

namespace phos {

// The frames of one received message; closes them when it goes away.
class Message {
public:
    Message() = default;
    Message(const Message&) = delete;
    Message& operator=(const Message&) = delete;
    ~Message() { clear(); }

    void clear();
    size_t count() const { return frames_.size(); }
    const void* data(size_t i) { return zmq_msg_data(&frames_[i]); }
    size_t size(size_t i) { return zmq_msg_size(&frames_[i]); }

private:
    friend class Socket;
    std::vector<zmq_msg_t> frames_;
};

// CURVE: reads PHOS_SERVER_KEY and PHOS_CLIENT_KEY (`phos keygen`'s files) and loads
// libsodium, once, before the first socket; without them sockets speak the NULL mechanism.
// False with the reason in `error` when keys are set but cannot be used.
bool configure_curve(std::string& error);
// The same with these key files (a restored process told the keys of the server it resumes against).
bool configure_curve_from(const std::string& server_key, const std::string& client_key, std::string& error);
// The server behind `endpoint` has this CURVE public key (z85), not PHOS_SERVER_KEY's: a
// context handed off to a server with keys of its own (Reply.moved).
void remember_server_key(const std::string& endpoint, const std::string& z85);

class Socket {
public:
    explicit Socket(const std::string& endpoint);
    Socket(const Socket&) = delete;
    Socket& operator=(const Socket&) = delete;
    ~Socket();

    // Closes the socket (dropping whatever it still queues) and connects a new one to
    // `endpoint`: how a connection moves to a restored context's new worker.
    void reopen(const std::string& endpoint);
    // Closes the socket and takes `other`'s connection instead (one made ahead to where a
    // handoff moves the context, its handshake done), leaving `other` closed.
    void take(Socket& other);

    bool ok() const { return socket_ != nullptr; }
    // The peer was connected and has been disconnected since, even if zmq has connected
    // again (a new peer, or the same one under a new routing id: either way it no longer
    // knows us). Looks at the monitor's events without waiting; reopen() clears it.
    bool lost();
    // The peer completed the ZeroMQ handshake on the current connection: a live process is
    // there (a dead one refuses the connection, a stopped one never greets). Looks at the
    // monitor's events without waiting; true when there is no monitor to ask.
    bool greeted();
    const std::string& endpoint() const { return endpoint_; }
    const std::string& error() const { return error_; }

    // Sends the Request frame then one frame per payload. Payloads go zero-copy: an owned
    // one stays alive until zmq is done with it, a borrowed one must outlive the reply.
    bool send(const std::string& request, const std::vector<const wire::Payload*>& payloads);

    enum class Wait { message, timeout, gone };
    // Waits at most poll_ms (0: only looks) for the next message: message, timeout, or gone
    // once the peer has been disconnected for PHOS_GONE_TIMEOUT.
    Wait receive_once(Message& message, int poll_ms);
    // A message waits to be received (cheap: no system call when nothing changed).
    bool readable();
    // Sleeps until a message may have arrived or `seconds` passed (finer than zmq_poll's
    // milliseconds); then readable() says whether one did.
    void wait_readable(double seconds);

private:
    void open();
    void close();
    void drain_monitor();

    std::string endpoint_;
    std::string error_;
    void* socket_ = nullptr;
    void* monitor_ = nullptr;
    bool connected_ = false;
    bool greeted_ = false;                        // handshake done on the current connection
    bool ever_connected_ = false;
    bool dropped_ = false;                        // disconnected at least once (lost())
    std::chrono::steady_clock::time_point disconnected_since_;
};

}  // namespace phos
