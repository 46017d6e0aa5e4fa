// Point-to-point messages: see mailbox.h.
#include "sdp/mailbox.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "sdp/common.h"
#include "sdp/group.h"
#include "sdp/transport.h"

namespace sdp {

struct Mailbox::In {  // the connection rank `src` opened to send to this rank
  int fd = -1;
  MessageHeader hdr{};
  size_t hdr_got = 0;   // bytes of the next message's header read (its payload: match_)
  bool reader = false;  // a waiting receive reads this connection itself (out of the epoll set)
};

struct Mailbox::Out {  // this rank's connection to rank `dst`
  int fd = -1;
  bool broken = false;
  std::string broken_why;
  std::deque<MailOpPtr> q;
  MessageHeader hdr{};
  size_t sent = 0;  // bytes of the front message sent, header included
};

Mailbox::Mailbox(int rank, int world_size, std::string secret, std::string bind_addr, double timeout_s, bool spin)
    : rank_(rank), world_(world_size), secret_(std::move(secret)), bind_addr_(std::move(bind_addr)), timeout_s_(timeout_s),
      spin_(spin), match_(world_size, *this) {
  if (world_size < 1 || rank < 0 || rank >= world_size) throw Error("mailbox: rank outside the group");
  for (int r = 0; r < world_; ++r) {
    in_.push_back(std::make_unique<In>());
    out_.push_back(std::make_unique<Out>());
  }
}

Mailbox::~Mailbox() { shutdown(); }

std::string Mailbox::who(int r) const {
  std::string s = "rank " + std::to_string(r);
  if (r >= 0 && r < int(addrs_.size())) s += " (" + addrs_[size_t(r)] + ")";
  return s;
}

int Mailbox::listen(PortRange ports) {
  int port = 0;
  listen_fd_ = listen_on(bind_addr_, &port, ports);
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(std::string("mailbox: pipe: ") + std::strerror(errno));
  ep_ = ::epoll_create1(EPOLL_CLOEXEC);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (ep_ < 0 || stop_fd_ < 0) throw Error(std::string("mailbox: epoll/eventfd: ") + std::strerror(errno));
  io_ = std::thread([this] {
    name_this_thread("sdp-mbox-io");
    io_loop();
  });
  acceptor_ = std::thread([this] {
    name_this_thread("sdp-mbox-accept");
    accept_loop();
  });
  return port;
}

void Mailbox::set_peers(std::vector<std::string> addrs, std::vector<int> ports) {
  if (int(addrs.size()) != world_ || int(ports.size()) != world_) throw Error("mailbox: need one address per rank");
  std::lock_guard<std::mutex> g(mu_);
  addrs_ = std::move(addrs);
  ports_ = std::move(ports);
}

void Mailbox::wake() {
  char b = 1;
  if (wake_[1] >= 0) (void)!::write(wake_[1], &b, 1);
}

void Mailbox::watch_in(int src, bool on) {
  // The I/O thread reads the incoming connections in its epoll set; a receive that reads one
  // itself takes it out meanwhile (level-triggered: put back with data pending, it fires at once).
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u32 = uint32_t(src);
  (void)::epoll_ctl(ep_, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, in_[size_t(src)]->fd, &ev);
}

void Mailbox::accept_loop() {
  // The listener stays open for the group's life (a message may come from anyone at any
  // time); only an authenticated rank of this job gets further than the handshake, and each
  // source rank gets one connection.
  serve_handshakes(
      listen_fd_, secret_, rank_, [this] { return stop_.load(); },
      [this](const PeerIdentity& id, int fd) {
        std::lock_guard<std::mutex> g(mu_);
        bool ok = id.role == Role::P2P && id.rank < uint32_t(world_) && int(id.rank) != rank_ &&
                  in_[id.rank]->fd < 0 && !match_.gone(int(id.rank));
        if (!ok) {
          log_warning("rank " + std::to_string(rank_) + " dropped a message connection claiming to be rank " +
                      std::to_string(id.rank) + " that it did not expect");
          ::close(fd);
          return;
        }
        set_nonblocking(fd);
        set_bulk_buffers(fd);
        set_link_liveness(fd, timeout_s_);
        in_[id.rank]->fd = fd;
        watch_in(id.rank, true);
        cv_.notify_all();  // a receive waiting for this rank may read the connection itself now
      });
}

uint64_t Mailbox::isend(int dst, int64_t tag, const void* data, size_t nbytes) {
  if (dst < 0 || dst >= world_) throw Error("send: destination rank " + std::to_string(dst) + " is outside the group");
  auto op = std::make_shared<MailOp>();
  op->send = true;
  op->peer = dst;
  op->tag = tag;
  op->data = static_cast<char*>(const_cast<void*>(data));
  op->nbytes = nbytes;
  if (dst == rank_) {  // to itself: delivered at once
    std::lock_guard<std::mutex> g(mu_);
    if (shut_) throw Error("send: the process group was shut down");
    uint64_t h = next_++;
    ops_[h] = op;
    match_.deliver_whole(rank_, tag, op->data, nbytes);
    op->finished = true;
    return h;
  }
  Out& o = *out_[size_t(dst)];
  {
    std::lock_guard<std::mutex> c(connect_mu_);
    bool need = false;
    std::string addr;
    int port = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (shut_) throw Error("send: the process group was shut down");
      if (o.broken) throw Error("send to " + who(dst) + " failed: " + o.broken_why);
      if (addrs_.empty()) throw Error("send: the group's addresses are not known yet");
      need = o.fd < 0;
      addr = addrs_[size_t(dst)];
      port = ports_[size_t(dst)];
    }
    if (need) {
      // In the caller's thread: the other side's acceptor answers without its I/O thread, so
      // two ranks opening connections to each other never wait on one another.
      PeerIdentity me{Role::P2P, 0, 0, uint32_t(rank_)};
      int fd;
      try {
        fd = connect_to(addr, port, secret_, me, now_s() + timeout_s_);
      } catch (const Error& e) {
        std::lock_guard<std::mutex> g(mu_);
        o.broken = true;
        o.broken_why = std::string("cannot reach it: ") + e.what();
        throw Error("send to " + who(dst) + " failed: " + o.broken_why);
      }
      set_nonblocking(fd);
      set_bulk_buffers(fd);
      set_link_liveness(fd, timeout_s_);
      std::lock_guard<std::mutex> g(mu_);
      o.fd = fd;
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  if (shut_) throw Error("send: the process group was shut down");
  uint64_t h = next_++;
  ops_[h] = op;
  if (o.q.empty() && o.fd >= 0) {
    // Nothing queued to this rank: the caller writes what the socket takes now, and the I/O
    // thread is woken only for the rest (a small message goes out with no thread hand-off).
    o.hdr = MessageHeader{kMessageMagic, uint32_t(rank_), tag, nbytes};
    iovec iov[2] = {{&o.hdr, sizeof(MessageHeader)}, {op->data, nbytes}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = nbytes ? 2 : 1;
    ssize_t r = ::sendmsg(o.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r == ssize_t(sizeof(MessageHeader) + nbytes)) {
      op->source = rank_;
      op->finished = true;
      return h;
    }
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      o.q.push_back(op);
      peer_closed_out(dst, std::string("the connection broke (") + std::strerror(errno) + ")");
      return h;
    }
    o.sent = r > 0 ? size_t(r) : 0;  // the I/O thread goes on from here (o.hdr is kept)
    o.q.push_back(op);
    wake();
    return h;
  }
  o.q.push_back(op);
  wake();
  return h;
}

uint64_t Mailbox::irecv(int src, int64_t tag, void* data, size_t nbytes) {
  if (src < -1 || src >= world_) throw Error("recv: source rank " + std::to_string(src) + " is outside the group");
  auto op = std::make_shared<MailOp>();
  op->peer = src;
  op->tag = tag;
  op->data = static_cast<char*>(data);
  op->nbytes = nbytes;
  std::lock_guard<std::mutex> g(mu_);
  if (shut_) throw Error("recv: the process group was shut down");
  uint64_t h = next_++;
  ops_[h] = op;
  match_.post(op);
  return h;
}

void Mailbox::peer_closed_in(int src, const std::string& why) {
  In& c = *in_[size_t(src)];
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
  match_.source_gone(src, why);
}

void Mailbox::peer_closed_out(int dst, const std::string& why) {
  Out& o = *out_[size_t(dst)];
  if (o.fd >= 0) ::close(o.fd);
  o.fd = -1;
  o.broken = true;
  o.broken_why = why;
  for (auto& op : o.q) match_.fail(op, "send to " + who(dst) + " failed: " + why);
  o.q.clear();
}

void Mailbox::resume(int src) {
  if (!in_[size_t(src)]->reader) watch_in(src, true);  // level-triggered: the I/O thread reads it at once
}

void Mailbox::pump_in(int src) {
  // Read everything that has arrived on src's connection: headers, then payloads where the
  // matcher says (straight into the matched receive's buffer, or kept for a later receive). mu_
  // held; called by the I/O thread, or by a receive that waits for src and reads its connection
  // itself (wait_reading).
  In& c = *in_[size_t(src)];
  while (c.fd >= 0 && !match_.parked(src)) {
    if (c.hdr_got < sizeof(MessageHeader)) {
      ssize_t r = ::recv(c.fd, reinterpret_cast<char*>(&c.hdr) + c.hdr_got, sizeof(MessageHeader) - c.hdr_got, 0);
      if (r == 0) { peer_closed_in(src, c.hdr_got ? "closed its connection in the middle of a message" : "closed its connection (it left the group or died)"); break; }
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        peer_closed_in(src, std::string("lost its connection (") + std::strerror(errno) + ")");
        break;
      }
      c.hdr_got += size_t(r);
      if (c.hdr_got < sizeof(MessageHeader)) continue;
      if (c.hdr.magic != kMessageMagic || c.hdr.src_rank != uint32_t(src)) {
        peer_closed_in(src, "sent a malformed message header");
        break;
      }
      match_.begin(src, c.hdr.tag, size_t(c.hdr.nbytes));
      if (match_.parked(src)) {  // nobody waits for src: the message stays in the socket
        if (!c.reader) watch_in(src, false);
        break;
      }
    }
    if (match_.receiving(src)) {
      Matcher::Space to = match_.space(src);
      ssize_t r = ::recv(c.fd, to.data, to.len, 0);
      if (r == 0) { peer_closed_in(src, "closed its connection in the middle of a message"); break; }
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        peer_closed_in(src, std::string("lost its connection (") + std::strerror(errno) + ")");
        break;
      }
      match_.received(src, size_t(r));
      if (match_.receiving(src)) continue;
    }
    c.hdr_got = 0;  // the message is complete
  }
}

void Mailbox::io_loop() {
  std::vector<pollfd> pfds;
  std::vector<int> who_out;
  char drain[256];
  while (!stop_) {
    pfds.clear();
    who_out.clear();
    pfds.push_back({wake_[0], POLLIN, 0});
    pfds.push_back({ep_, POLLIN, 0});  // the incoming connections nobody else is reading
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int r = 0; r < world_; ++r) {
        if (out_[size_t(r)]->fd >= 0 && !out_[size_t(r)]->q.empty()) {
          pfds.push_back({out_[size_t(r)]->fd, POLLOUT, 0});
          who_out.push_back(r);
        }
      }
    }
    int n = ::poll(pfds.data(), nfds_t(pfds.size()), 200);
    if (n < 0 && errno != EINTR) break;
    if (pfds[0].revents & POLLIN)
      while (::read(wake_[0], drain, sizeof drain) > 0) {}
    std::lock_guard<std::mutex> g(mu_);
    size_t k = 2;
    if (pfds[1].revents & POLLIN) {
      epoll_event evs[64];
      int ready = ::epoll_wait(ep_, evs, 64, 0);
      for (int i = 0; i < ready; ++i) {
        int src = int(evs[i].data.u32);
        In& c = *in_[size_t(src)];
        if (c.fd >= 0 && !c.reader && !match_.parked(src)) pump_in(src);  // a waiting receive may be reading it itself
      }
    }
    for (int dst : who_out) {
      short ev = pfds[k++].revents;
      if (!ev) continue;
      Out& o = *out_[size_t(dst)];
      if (ev & (POLLERR | POLLHUP) && !(ev & POLLOUT)) {
        peer_closed_out(dst, "its connection closed");
        continue;
      }
      while (o.fd >= 0 && !o.q.empty()) {
        auto& op = o.q.front();
        if (o.sent == 0) o.hdr = MessageHeader{kMessageMagic, uint32_t(rank_), op->tag, op->nbytes};
        size_t total = sizeof(MessageHeader) + op->nbytes;
        const char* p;
        size_t len;
        if (o.sent < sizeof(MessageHeader)) {
          p = reinterpret_cast<const char*>(&o.hdr) + o.sent;
          len = sizeof(MessageHeader) - o.sent;
        } else {
          p = op->data + (o.sent - sizeof(MessageHeader));
          len = total - o.sent;
        }
        if (len) {
          ssize_t r = ::send(o.fd, p, len, MSG_NOSIGNAL);
          if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            peer_closed_out(dst, std::string("the connection broke (") + std::strerror(errno) + ")");
            break;
          }
          o.sent += size_t(r);
        }
        if (o.sent == total) {
          op->source = rank_;
          op->finished = true;
          o.q.pop_front();
          o.sent = 0;
          cv_.notify_all();
        }
      }
    }
  }
}

int Mailbox::wait(uint64_t handle, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) throw Error("wait: unknown or already finished message handle");
  auto op = it->second;
  double t = timeout_s > 0 ? timeout_s : timeout_s_;
  double deadline = now_s() + t;
  while (!op->finished && !shut_) {
    double left = deadline - now_s();
    if (left <= 0) break;
    if (!op->send && op->peer >= 0 && op->peer != rank_ && op->nbytes <= kSpinMaxBytes) {
      In& c = *in_[size_t(op->peer)];
      if (c.fd >= 0 && !c.reader) {
        wait_reading(lk, *op, op->peer, deadline);
        continue;
      }
    }
    cv_.wait_for(lk, std::chrono::duration<double>(std::min(left, 0.5)));
  }
  ops_.erase(handle);
  std::string what = op->send ? "send to " + who(op->peer) : (op->peer < 0 ? std::string("recv from any rank") : "recv from " + who(op->peer));
  what += " (" + tag_text(op->tag) + ", " + std::to_string(op->nbytes) + " bytes)";
  if (!op->finished) {
    // Withdraw it, so nothing writes into (or reads from) the caller's buffer any more.
    if (shut_) throw Error(what + " failed: the process group was shut down");
    if (op->send) {
      Out& o = *out_[size_t(op->peer)];
      auto qit = std::find(o.q.begin(), o.q.end(), op);
      if (qit == o.q.begin() && o.sent > 0) {
        peer_closed_out(op->peer, "a send timed out half-way, so the connection was closed");
      } else if (qit != o.q.end()) {
        o.q.erase(qit);
      }
    } else {
      match_.withdraw(op);  // out of the posted list; the rest of a message it was taking is dropped
    }
    op->finished = true;
    throw Error(what + ": Timed out after " + fmt_seconds(t) + " s on rank " + std::to_string(rank_));
  }
  if (!op->error.empty()) throw Error(what + " failed on rank " + std::to_string(rank_) + ": " + op->error);
  return op->source;
}

void Mailbox::wait_reading(std::unique_lock<std::mutex>& lk, const MailOp& op, int src, double deadline) {
  // A small receive from one rank (up to kSpinMaxBytes) reads that rank's connection in its own
  // thread: no hand-off from the I/O thread, whose wake-up costs tens of microseconds on a busy
  // machine, most of a small message's time. It polls before it sleeps unless SDP_SPIN=0. mu_
  // is held only while reading; the connection stays ours (c.reader) until the receive is done.
  // A large receive leaves the reading to the I/O thread: one hand-off at its end is nothing
  // against the transfer (measured: reading it here was 5% slower with 4 ranks on 2 cores).
  In& c = *in_[size_t(src)];
  const int fd = c.fd;
  c.reader = true;
  watch_in(src, false);
  pump_in(src);
  SpinWindow spin(spin_);
  while (!op.finished && !shut_ && c.fd == fd) {
    double now = now_s();
    if (now >= deadline) break;
    bool spinning = spin.spinning();
    int ms = spinning ? 0 : int(std::min(deadline - now, 1.0) * 1000) + 1;
    lk.unlock();
    pollfd p[2] = {{fd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    int n = ::poll(p, 2, ms);
    if (n == 0 && spinning) sched_yield();
    lk.lock();
    if (n > 0 && p[0].revents && c.fd == fd) {
      pump_in(src);
      spin.progress();
    }
  }
  if (c.fd == fd && !match_.parked(src)) watch_in(src, true);  // the I/O thread reads it again (at once if data waits)
  c.reader = false;
  cv_.notify_all();  // shutdown waits for readers to let go before closing the connections
}

bool Mailbox::test(uint64_t handle) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return true;
  return it->second->finished;
}

void Mailbox::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shut_) return;
    shut_ = true;
    for (auto& [h, op] : ops_) match_.fail(op, "the process group was shut down");
    match_.drop_posted();
  }
  stop_ = true;
  wake();
  if (stop_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof one);  // receives reading their connections return
  }
  if (acceptor_.joinable()) acceptor_.join();
  if (io_.joinable()) io_.join();
  std::unique_lock<std::mutex> g(mu_);
  auto reading = [this] {
    return std::any_of(in_.begin(), in_.end(), [](const std::unique_ptr<In>& c) { return c->reader; });
  };
  cv_.wait_for(g, std::chrono::seconds(5), [&] { return !reading(); });
  for (auto& c : in_)
    if (c->fd >= 0) { ::close(c->fd); c->fd = -1; }
  for (auto& o : out_) {
    if (o->fd >= 0) { ::close(o->fd); o->fd = -1; }
    o->q.clear();
  }
  if (listen_fd_ >= 0) { ::close(listen_fd_); listen_fd_ = -1; }
  for (int& f : wake_)
    if (f >= 0) { ::close(f); f = -1; }
  for (int* f : {&ep_, &stop_fd_})
    if (*f >= 0) { ::close(*f); *f = -1; }
}

}  // namespace sdp
