#include "sdp/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "sdp/hmac.h"

namespace sdp {
namespace {


Digest client_mac(const std::string& secret, const uint8_t* server_nonce, const ClientProof& p) {
  std::vector<uint8_t> msg;
  msg.push_back('C');
  msg.insert(msg.end(), server_nonce, server_nonce + 32);
  const uint8_t* body = reinterpret_cast<const uint8_t*>(&p);
  msg.insert(msg.end(), body, body + offsetof(ClientProof, mac));
  return hmac_sha256(secret, msg.data(), msg.size());
}

Digest server_mac(const std::string& secret, const uint8_t* server_nonce, const uint8_t* client_nonce) {
  uint8_t msg[1 + 64];
  msg[0] = 'S';
  std::memcpy(msg + 1, client_nonce, 32);
  std::memcpy(msg + 33, server_nonce, 32);
  return hmac_sha256(secret, msg, sizeof(msg));
}

bool wait_fd(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, int(left * 1000) + 1);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

}  // namespace

void set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void set_socket_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void set_bulk_buffers(int fd) {
  // Fixed socket buffers between node leaders (SDP_SOCKET_BUFFER bytes, 0: kernel autotuning).
  // 256 KiB was the steadiest of autotuning, 256 KiB and 4 MiB on loopback (docs/benchmarks.md):
  // larger buffers let more data go cold in the kernel before the receiver copies it out.
  // The kernel caps the value at net.core.wmem_max / rmem_max.
  int bytes = int(env_int("SDP_SOCKET_BUFFER", 0, 0, 1 << 30));
  if (bytes <= 0) return;  // 0: leave the kernel's autotuning alone
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

bool write_all(int fd, const void* buf, size_t len, double deadline) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) { p += n; len -= size_t(n); continue; }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_fd(fd, POLLOUT, deadline)) return false;
      continue;
    }
    return false;
  }
  return true;
}

bool read_all(int fd, void* buf, size_t len, double deadline) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) { p += n; len -= size_t(n); continue; }
    if (n == 0) return false;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_fd(fd, POLLIN, deadline)) return false;
      continue;
    }
    return false;
  }
  return true;
}

std::string peer_address(int fd) {
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) return "?";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&ss), sl, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return std::string(host) + ":" + serv;
}

// One listening socket on addr:service (service "0": any free port); -1 with *last set when none.
static int try_listen(const std::string& addr, const std::string& service, std::string* last) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(addr.empty() ? nullptr : addr.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) throw Error("cannot resolve bind address '" + addr + "': " + gai_strerror(rc) +
                           " (set SDP_BIND_ADDR to an address of this host)");
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    *last = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  return fd;
}

int listen_on(const std::string& addr, int* port_out, PortRange range) {
  std::string last;
  int fd = -1;
  if (range.lo <= 0) {
    fd = try_listen(addr, "0", &last);
    if (fd < 0) throw Error("cannot listen on '" + addr + "': " + last + " (set SDP_BIND_ADDR)");
  } else {
    // Start at a place that differs between processes, so the ranks of a node do not all race
    // for the range's first port.
    int n = range.hi - range.lo + 1;
    int start = int(getpid() % n);
    for (int i = 0; i < n && fd < 0; ++i) fd = try_listen(addr, std::to_string(range.lo + (start + i) % n), &last);
    if (fd < 0)
      throw Error("cannot listen on '" + addr + "': no port of SDP_PORT_RANGE=" + std::to_string(range.lo) + "-" +
                  std::to_string(range.hi) + " is free (" + last + "): widen the range");
  }
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  *port_out = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

int connect_to(const std::string& addr, int port, const std::string& secret, const PeerIdentity& me,
               double deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(port);
  int rc = getaddrinfo(addr.c_str(), ps.c_str(), &hints, &res);
  if (rc != 0) throw Error("cannot resolve peer address '" + addr + "': " + gai_strerror(rc));
  std::string last = "timed out";
  int fd = -1;
  while (now_s() < deadline) {
    for (addrinfo* ai = res; ai && fd < 0; ai = ai->ai_next) {
      int s = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (s < 0) continue;
      int rc2 = ::connect(s, ai->ai_addr, ai->ai_addrlen);
      if (rc2 != 0 && errno == EINPROGRESS) {
        // Bounded by the deadline: a listener whose backlog is full never answers the SYN.
        if (wait_fd(s, POLLOUT, std::min(deadline, now_s() + 2.0))) {
          int err = 0;
          socklen_t el = sizeof(err);
          getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
          rc2 = err == 0 ? 0 : -1;
          errno = err;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (rc2 == 0) { fd = s; break; }
      last = std::strerror(errno);
      ::close(s);
    }
    if (fd >= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  freeaddrinfo(res);
  if (fd < 0)
    throw Error("cannot connect to " + addr + ":" + ps + " within the deadline (" + last + ")");
  set_socket_options(fd);
  ServerHello hello{};
  double hs_deadline = std::min(deadline, now_s() + 30.0);
  if (!read_all(fd, &hello, sizeof(hello), hs_deadline) || hello.magic != kHelloMagic) {
    ::close(fd);
    throw Error("peer at " + addr + ":" + ps + " is not an smddp engine (bad greeting)");
  }
  if (hello.version != kProtocolVersion) {
    ::close(fd);
    throw Error("peer at " + addr + ":" + ps + " speaks protocol version " + std::to_string(hello.version) +
                ", this engine speaks " + std::to_string(kProtocolVersion) + ": install the same sdp_jupyter everywhere");
  }
  ClientProof proof{};
  proof.magic = kHelloMagic;
  proof.version = kProtocolVersion;
  proof.role = uint8_t(me.role);
  proof.node = me.node;
  proof.local_rank = me.local_rank;
  proof.rank = me.rank;
  random_bytes(proof.nonce, 32);
  Digest m = client_mac(secret, hello.nonce, proof);
  std::memcpy(proof.mac, m.data(), 32);
  if (!write_all(fd, &proof, sizeof(proof), hs_deadline)) {
    ::close(fd);
    throw Error("connection to " + addr + ":" + ps + " closed during authentication");
  }
  ServerProof sp{};
  if (!read_all(fd, &sp, sizeof(sp), hs_deadline) || sp.magic != kHelloMagic) {
    ::close(fd);
    throw Error("peer at " + addr + ":" + ps + " rejected this rank's proof of the job secret "
                "(SDP_JOB_SECRET differs between ranks?)");
  }
  Digest expect = server_mac(secret, hello.nonce, proof.nonce);
  Digest got;
  std::memcpy(got.data(), sp.mac, 32);
  if (!digest_equal(expect, got)) {
    ::close(fd);
    throw Error("peer at " + addr + ":" + ps + " does not know the job secret: refusing to exchange data with it");
  }
  return fd;
}

ServerHandshake::ServerHandshake(int fd, double deadline) : fd_(fd), deadline_(deadline) {
  set_nonblocking(fd);
  set_socket_options(fd);
  hello_.magic = kHelloMagic;
  hello_.version = kProtocolVersion;
  random_bytes(hello_.nonce, 32);
  // 40 bytes into a fresh socket's empty send buffer: a short write means something is wrong.
  ssize_t n = ::send(fd, &hello_, sizeof(hello_), MSG_NOSIGNAL);
  failed_ = n != ssize_t(sizeof(hello_));
}

int ServerHandshake::step(const std::string& secret, PeerIdentity* who, std::string* why) {
  if (failed_) { *why = "closed before the greeting"; return -1; }
  while (got_ < sizeof(proof_)) {
    ssize_t n = ::recv(fd_, reinterpret_cast<char*>(&proof_) + got_, sizeof(proof_) - got_, 0);
    if (n > 0) { got_ += size_t(n); continue; }
    if (n == 0) { *why = "closed during authentication"; return -1; }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (now_s() > deadline_) { *why = "did not authenticate before its deadline"; return -1; }
      return 0;
    }
    *why = std::string("failed during authentication (") + std::strerror(errno) + ")";
    return -1;
  }
  if (proof_.magic != kHelloMagic) { *why = "sent garbage instead of a handshake"; return -1; }
  if (proof_.version != kProtocolVersion) { *why = "speaks another protocol version"; return -1; }
  Digest expect = client_mac(secret, hello_.nonce, proof_);
  Digest got;
  std::memcpy(got.data(), proof_.mac, 32);
  if (!digest_equal(expect, got)) { *why = "failed the job-secret challenge"; return -1; }
  if (proof_.role != uint8_t(Role::NODE) && proof_.role != uint8_t(Role::LOCAL) && proof_.role != uint8_t(Role::P2P)) { *why = "claimed an unknown role"; return -1; }
  ServerProof sp{};
  sp.magic = kHelloMagic;
  Digest m = server_mac(secret, hello_.nonce, proof_.nonce);
  std::memcpy(sp.mac, m.data(), 32);
  if (!write_all(fd_, &sp, sizeof(sp), std::min(deadline_, now_s() + 1.0))) { *why = "closed during authentication"; return -1; }
  who->role = Role(proof_.role);
  who->node = proof_.node;
  who->local_rank = proof_.local_rank;
  who->rank = proof_.rank;
  return 1;
}

void set_link_liveness(int fd, double timeout_s) {
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 5, intvl = 2, cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  // Data unacknowledged this long fails the socket (a cut link), but a slow link that still
  // acknowledges is never cut short: bounded to 10..120 s around the collective timeout.
  double t = timeout_s < 10 ? 10 : (timeout_s > 120 ? 120 : timeout_s);
  unsigned int ms = unsigned(t * 1000);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

void serve_handshakes(int listen_fd, const std::string& secret, int rank, const std::function<bool()>& stop,
                      const std::function<void(const PeerIdentity&, int)>& on_peer) {
  // The caller closes the listener as soon as set-up is done: after that nobody has a reason
  // to connect.
  // At most kMaxPending unauthenticated sockets are held. When they are all taken, the oldest is
  // dropped for a newcomer, but only once it has had kGraceSeconds to answer: evicting by count
  // alone let a burst of strangers push a real rank out before its thread was even scheduled
  // (seen on a loaded 2-core host under the sanitizers). Until then newcomers wait in the kernel's
  // backlog, so a flood costs the real rank at most kGraceSeconds per kMaxPending strangers.
  constexpr size_t kMaxPending = 64;
  constexpr double kHandshakeSeconds = 5.0;
  constexpr double kGraceSeconds = 0.25;
  std::deque<ServerHandshake> pending;
  auto drop = [&](ServerHandshake& h, const std::string& why) {
    log_warning("rank " + std::to_string(rank) + " dropped a connection from " + peer_address(h.fd()) + ": it " + why);
    ::close(h.fd());
  };
  auto evictable = [&]() {
    return pending.front().deadline() - kHandshakeSeconds + kGraceSeconds <= now_s();
  };
  std::vector<pollfd> pfds;
  for (;;) {
    if (stop()) break;
    bool full = pending.size() >= kMaxPending;
    bool can_accept = !full || evictable();
    pfds.clear();
    pfds.push_back({listen_fd, short(can_accept ? POLLIN : 0), 0});
    for (auto& h : pending) pfds.push_back({h.fd(), POLLIN, 0});
    int r = ::poll(pfds.data(), nfds_t(pfds.size()), can_accept ? 100 : 20);
    if (r < 0 && errno != EINTR) break;
    if (can_accept && (pfds[0].revents & POLLIN)) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        if (full) {
          drop(pending.front(), "was still unauthenticated when newer connections came");
          pending.pop_front();
        }
        pending.emplace_back(fd, now_s() + kHandshakeSeconds);
      }
    }
    for (auto it = pending.begin(); it != pending.end();) {
      PeerIdentity who{};
      std::string why;
      int st = it->step(secret, &who, &why);
      if (st == 0) { ++it; continue; }
      if (st < 0) {
        drop(*it, why);
      } else {
        on_peer(who, it->fd());
      }
      it = pending.erase(it);
    }
  }
  for (auto& h : pending) ::close(h.fd());
}

}  // namespace sdp
