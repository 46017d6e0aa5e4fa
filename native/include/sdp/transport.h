// TCP transport: listening, authenticated connection set-up, and framed messages.
//
// Every connection starts with a mutual HMAC-SHA256 challenge over two fresh nonces, so a
// process that does not know the job's secret can neither join nor inject data. After the
// handshake, sockets are non-blocking and carry frames: a fixed header followed by a payload.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "sdp/common.h"
#include "sdp/frame.h"

namespace sdp {

constexpr uint32_t kHelloMagic = 0x48504453;  // "SDPH"
constexpr uint32_t kProtocolVersion = 1;

enum class Role : uint8_t { NODE = 1, LOCAL = 2, P2P = 3 };  // P2P: a mailbox connection (mailbox.h)

#pragma pack(push, 1)
// The handshake's messages (server greeting, client proof, server proof).
struct ServerHello {
  uint32_t magic;
  uint32_t version;
  uint8_t nonce[32];
};
struct ClientProof {
  uint32_t magic;
  uint32_t version;
  uint8_t role;
  uint8_t pad[3];
  uint32_t node;
  uint32_t local_rank;
  uint32_t rank;
  uint8_t nonce[32];
  uint8_t mac[32];
};
struct ServerProof {
  uint32_t magic;
  uint8_t mac[32];
};
#pragma pack(pop)

// Who is on the other end, as proved during the handshake.
struct PeerIdentity {
  Role role;
  uint32_t node;
  uint32_t local_rank;
  uint32_t rank;
};

// Ports a listener may take: [lo, hi] inclusive, or any free port when lo is 0 (SDP_PORT_RANGE,
// for firewalls that open one range).
struct PortRange {
  int lo = 0;
  int hi = 0;
};

int listen_on(const std::string& addr, int* port_out, PortRange range = {});
// Connects (non-blocking, retrying until deadline), then runs the client half of the handshake;
// nothing here waits past `deadline`.
int connect_to(const std::string& addr, int port, const std::string& secret, const PeerIdentity& me,
               double deadline);

// The server half of the handshake on one accepted (non-blocking) socket, advanced by the
// acceptor's poll loop a few bytes at a time, so a stranger that connects and says nothing
// holds up nobody: it is dropped at its deadline.
class ServerHandshake {
 public:
  ServerHandshake(int fd, double deadline);  // sends the greeting; failed() if it could not
  // Reads what has arrived: 1 authenticated (who filled, server proof sent), 0 needs more,
  // -1 failed (why filled). The caller closes the socket on -1.
  int step(const std::string& secret, PeerIdentity* who, std::string* why);
  bool failed() const { return failed_; }
  int fd() const { return fd_; }
  double deadline() const { return deadline_; }

 private:
  int fd_;
  double deadline_;
  bool failed_ = false;
  ServerHello hello_{};
  ClientProof proof_{};
  size_t got_ = 0;
};

// The server side of set-up: accepts on `listen_fd` and runs the handshakes, many at once,
// each a few bytes at a time with its own deadline, so a stranger that connects and sends
// nothing delays nobody; at most a few unauthenticated sockets are held (the oldest is dropped
// for a new one once it has had a short grace to answer). Every authenticated socket goes to on_peer; returns once stop() is true.
void serve_handshakes(int listen_fd, const std::string& secret, int rank, const std::function<bool()>& stop,
                      const std::function<void(const PeerIdentity&, int)>& on_peer);

void set_nonblocking(int fd);
void set_bulk_buffers(int fd);
void set_socket_options(int fd);
// Peer links: keepalive probes and TCP_USER_TIMEOUT, so a host that vanishes (link cut,
// power off) is noticed by the kernel even when no data is in flight.
void set_link_liveness(int fd, double timeout_s);
// Blocking helpers with a deadline, used during set-up and for error frames.
bool write_all(int fd, const void* buf, size_t len, double deadline);
bool read_all(int fd, void* buf, size_t len, double deadline);
std::string peer_address(int fd);

}  // namespace sdp
