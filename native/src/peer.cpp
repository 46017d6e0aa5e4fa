#include "sdp/peer.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "sdp/transport.h"

namespace sdp {

FrameHeader Links::frame_base(const Work& w) const {
  FrameHeader base{};
  base.magic = kFrameMagic;
  base.type = uint8_t(FrameType::DATA);
  base.coll = uint8_t(w.coll);
  base.dtype = uint8_t(w.dtype);
  base.op = uint8_t(w.op);
  base.src_rank = uint32_t(topo_.rank);
  base.root = uint32_t(w.root);
  base.seq = op_.seq;
  base.count = w.count;
  return base;
}

void Links::post_send(int node, const FrameHeader& h, const char* data) {
  Peer& p = peers_[node];
  p.sends_posted++;
  if (p.send_active) {
    p.sendq.push_back({h, data});
    return;
  }
  p.shdr = h;
  p.sdata = data;
  p.slen = h.nbytes;
  p.sdone = 0;
  p.send_active = true;
}

void Links::post_recv(int node, const FrameHeader& expect, char* dst) {
  Peer& p = peers_[node];
  p.recvs_posted++;
  if (p.recv_active) {
    p.recvq.push_back({expect, dst});
    return;
  }
  p.expect = expect;
  p.rdata = dst;
  p.rhdr_done = p.rdone = 0;
  p.recv_active = true;
}

bool Links::pump_all(int scatter_set, std::vector<pollfd>& pfds, std::vector<Peer*>& who) {
  pfds.clear();
  who.clear();
  bool reached = true;
  for (auto& p : peers_) {
    if (p.fd < 0) continue;
    if (p.send_active) pump_send(p);
    if (p.recv_active) pump_recv(p);
    if (scatter_set < 0 ? (p.send_active || p.recv_active) : p.recvs_done < p.scatter_mark[scatter_set]) reached = false;
    short ev = short((p.send_active ? POLLOUT : 0) | (p.recv_active ? POLLIN : 0));
    if (ev) {
      pfds.push_back({p.fd, ev, 0});
      who.push_back(&p);
    }
  }
  if (!reached && pfds.empty()) op_.fail("internal error in " + op_.desc() + ": waiting for frames that were never posted");
  return reached;
}

void Links::check_stalled(const std::vector<Peer*>& who) {
  op_.check_health();
  if (now_s() > op_.deadline) {
    std::string late;
    for (Peer* p : who) late += (late.empty() ? "" : ", ") + topo_.rank_name(p->rank);
    op_.fail("timed out after " + fmt_seconds(op_.timeout_s) + " s in " + op_.desc() + " waiting for node leader " + late +
             " (that host is unreachable or stalled, or a rank there is not calling this collective)");
  }
}

void Links::exchange(int scatter_set) {
  std::vector<pollfd> pfds;
  std::vector<Peer*> who;
  bool small = spin_;  // every frame posted is small: poll before sleeping (kSpinMaxBytes)
  for (const auto& p : peers_) {
    if (!small) break;
    if (p.send_active) small = p.slen <= kSpinMaxBytes;
    if (p.recv_active) small = small && p.expect.nbytes <= kSpinMaxBytes;
    for (const auto& o : p.sendq) small = small && o.h.nbytes <= kSpinMaxBytes;
    for (const auto& i : p.recvq) small = small && i.expect.nbytes <= kSpinMaxBytes;
  }
  SpinWindow spin(small);
  for (;;) {
    if (pump_all(scatter_set, pfds, who)) return;
    bool spinning = spin.spinning();
    int r = ::poll(pfds.data(), nfds_t(pfds.size()), spinning ? 0 : 50);
    if (r > 0) spin.progress();
    if (r == 0 && spinning) {
      sched_yield();
      continue;
    }
    if (r == 0 || (r < 0 && errno == EINTR)) check_stalled(who);
  }
}

void Links::mark_done(int set) {
  for (auto& p : peers_) {
    p.done_recvs[set] = p.recvs_posted;
    p.done_sends[set] = p.sends_posted;
  }
}

void Links::step(int wait_us) {
  if (pump_all(-1, pfds_, who_) || wait_us <= 0) return;
  timespec ts{wait_us / 1000000, long(wait_us % 1000000) * 1000};
  int r = ::ppoll(pfds_.data(), nfds_t(pfds_.size()), &ts, nullptr);
  if (r == 0 || (r < 0 && errno == EINTR)) {
    check_stalled(who_);
    return;
  }
  pump_all(-1, pfds_, who_);
}

bool Links::scattered(int set) const {
  for (const auto& p : peers_)
    if (p.fd >= 0 && p.recvs_done < p.scatter_mark[set]) return false;
  return true;
}

bool Links::done(int set) const {
  for (const auto& p : peers_)
    if (p.fd >= 0 && (p.recvs_done < p.done_recvs[set] || p.sends_done < p.done_sends[set])) return false;
  return true;
}

bool Links::pump_send(Peer& p) {
  while (p.send_active) {
    iovec iov[2];
    int n = 0;
    if (p.sdone < sizeof(FrameHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&p.shdr) + p.sdone, sizeof(FrameHeader) - p.sdone};
      if (p.slen) iov[n++] = {const_cast<char*>(p.sdata), p.slen};
    } else {
      size_t dd = p.sdone - sizeof(FrameHeader);
      iov[n++] = {const_cast<char*>(p.sdata) + dd, p.slen - dd};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(n);
    ssize_t r = ::sendmsg(p.fd, &mh, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      int err = errno;
      raise_cause_from(p);  // `p` may have closed right after telling this rank which rank died
      const char* why = std::strerror(err);  // before desc() allocates
      op_.fail("connection to " + topo_.rank_name(p.rank) + " failed during " + op_.desc() + " (" + why +
               "): that rank exited or its host is unreachable");
    }
    p.sdone += size_t(r);
    if (p.sdone == sizeof(FrameHeader) + p.slen) {
      p.send_active = false;
      p.sends_done++;
      if (!p.sendq.empty()) {
        Peer::Out o = p.sendq.front();
        p.sendq.pop_front();
        p.shdr = o.h;
        p.sdata = o.data;
        p.slen = o.h.nbytes;
        p.sdone = 0;
        p.send_active = true;
      }
    }
  }
  return true;
}

void Links::raise_cause_from(Peer& p) {
  // A peer that fails because a third rank died writes an ERROR frame naming that rank (Engine::fail)
  // and may exit at once; a send to it then fails (EPIPE) while the frame still waits in this socket's
  // receive queue. Read on to it: what this rank expects from `p` first, then one frame boundary.
  for (int frames = 0; frames < 64; ++frames) {
    if (p.recv_active || p.rhdr_done != 0) {
      if (!pump_recv(p)) return;  // nothing more there now (it raises on `p`'s end or its ERROR frame)
      continue;
    }
    FrameHeader h{};
    ssize_t n = ::recv(p.fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
    if (n < ssize_t(sizeof(h)) || h.magic != kFrameMagic || h.type != uint8_t(FrameType::ERROR)) return;
    pump_recv(p);  // reads and raises the peer's message
    return;
  }
}

void Links::check_frame(const Peer& p) {
  const FrameHeader& g = p.rhdr;
  const FrameHeader& e = p.expect;
  std::string field, va, vb;
  if (first_difference(Described{e.seq, e.count, e.root, e.coll, e.dtype, e.op},
                       Described{g.seq, g.count, g.root, g.coll, g.dtype, g.op}, &field, &va, &vb))
    op_.fail("collective mismatch at " + op_.desc() + ": " + field + " differs: rank " + std::to_string(topo_.rank) + " has " +
             va + ", " + topo_.rank_name(p.rank) + " has " + vb + "; nothing was reduced");
  if (g.offset != e.offset || g.nbytes != e.nbytes)
    op_.fail("protocol error in " + op_.desc() + ": " + topo_.rank_name(p.rank) + " sent bytes " + std::to_string(g.offset) +
             "+" + std::to_string(g.nbytes) + " where " + std::to_string(e.offset) + "+" + std::to_string(e.nbytes) +
             " was expected");
}

bool Links::pump_recv(Peer& p) {
  for (;;) {
    if (p.rhdr_done < sizeof(FrameHeader)) {
      ssize_t r = ::recv(p.fd, reinterpret_cast<char*>(&p.rhdr) + p.rhdr_done, sizeof(FrameHeader) - p.rhdr_done, 0);
      if (r == 0) op_.fail(topo_.rank_name(p.rank) + " exited or closed its connection during " + op_.desc());
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
        const char* why = std::strerror(errno);  // before desc() allocates
        op_.fail("connection to " + topo_.rank_name(p.rank) + " failed during " + op_.desc() + " (" + why + ")");
      }
      p.rhdr_done += size_t(r);
      if (p.rhdr_done < sizeof(FrameHeader)) continue;
      const FrameHeader& g = p.rhdr;
      if (g.magic != kFrameMagic)
        op_.fail("protocol error: " + topo_.rank_name(p.rank) + " sent a malformed frame during " + op_.desc());
      if (g.type == uint8_t(FrameType::ERROR)) {
        std::string m(std::min<uint64_t>(g.nbytes, 4096), '\0');
        if (m.empty() || !read_all(p.fd, m.data(), m.size(), now_s() + 2.0) || m.find_first_not_of('\0') == std::string::npos)
          m = "rank " + std::to_string(g.src_rank) + " reported an error (its message was lost)";
        // A peer's text becomes a Python exception message: printable ASCII only (bytes that are
        // not valid UTF-8 once turned the engine's error into a UnicodeDecodeError: the fuzzer's find).
        for (char& c : m)
          if ((c < 0x20 || c > 0x7e) && c != '\n' && c != '\t') c = '?';
        op_.fail(m, /*remote=*/true);
      }
      if (g.type == uint8_t(FrameType::BYE)) {
        p.bye = true;
        op_.fail(topo_.rank_name(p.rank) + " shut down its process group while this rank was in " + op_.desc());
      }
      if (g.type != uint8_t(FrameType::DATA))
        op_.fail("protocol error: " + topo_.rank_name(p.rank) + " sent an unknown frame type during " + op_.desc());
      if (!p.recv_active)
        op_.fail("protocol error: " + topo_.rank_name(p.rank) + " sent data this rank did not expect during " + op_.desc());
      check_frame(p);
    }
    if (!p.recv_active) return true;
    size_t want = p.rhdr.nbytes - p.rdone;
    if (want == 0) {
      p.recv_active = false;
      p.recvs_done++;
      if (p.recvq.empty()) return true;
      Peer::In in = p.recvq.front();
      p.recvq.pop_front();
      p.expect = in.expect;
      p.rdata = in.dst;
      p.rhdr_done = p.rdone = 0;
      p.recv_active = true;
      continue;
    }
    ssize_t r = ::recv(p.fd, p.rdata + p.rdone, want, 0);
    if (r == 0) op_.fail(topo_.rank_name(p.rank) + " exited or closed its connection during " + op_.desc());
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      const char* why = std::strerror(errno);  // before desc() allocates
      op_.fail("connection to " + topo_.rank_name(p.rank) + " failed during " + op_.desc() + " (" + why + ")");
    }
    p.rdone += size_t(r);
  }
}

void Links::start(double timeout_s) {
  for (auto& p : peers_)
    if (p.fd >= 0) {
      set_nonblocking(p.fd);
      set_bulk_buffers(p.fd);
      set_link_liveness(p.fd, timeout_s);
    }
}

void Links::send_error_frames(const std::string& msg) {
  if (error_frames_sent_) return;
  error_frames_sent_ = true;
  double deadline = now_s() + 1.0;
  for (auto& p : peers_) {
    p.sendq.clear();
    p.recvq.clear();
    if (p.fd < 0 || p.bye) continue;
    if (p.send_active) {  // finish the frame in flight so the peer can parse what follows
      size_t hdr_left = p.sdone < sizeof(FrameHeader) ? sizeof(FrameHeader) - p.sdone : 0;
      bool ok = true;
      if (hdr_left) ok = write_all(p.fd, reinterpret_cast<const char*>(&p.shdr) + p.sdone, hdr_left, deadline);
      size_t data_done = p.sdone > sizeof(FrameHeader) ? p.sdone - sizeof(FrameHeader) : 0;
      if (ok && p.slen > data_done) ok = write_all(p.fd, p.sdata + data_done, p.slen - data_done, deadline);
      p.send_active = false;
      if (!ok) continue;
    }
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.type = uint8_t(FrameType::ERROR);
    h.src_rank = uint32_t(topo_.rank);
    h.seq = op_.seq;
    h.nbytes = std::min<size_t>(msg.size(), 2000);
    if (write_all(p.fd, &h, sizeof(h), deadline)) write_all(p.fd, msg.data(), h.nbytes, deadline);
  }
}

void Links::idle_check() {
  for (auto& p : peers_) {
    if (p.fd < 0 || p.bye) continue;
    FrameHeader h{};
    ssize_t n = ::recv(p.fd, &h, sizeof(h), MSG_PEEK);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      op_.fail(topo_.rank_name(p.rank) + " (leader of node " + std::to_string(p.node) + ") lost its connection while this rank was idle");
    }
    if (n == 0)
      op_.fail(topo_.rank_name(p.rank) + " (leader of node " + std::to_string(p.node) +
               ") exited or closed its connection while this rank was idle");
    if (size_t(n) < sizeof(h) || h.magic != kFrameMagic) continue;
    if (h.type == uint8_t(FrameType::BYE)) {
      ::recv(p.fd, &h, sizeof(h), 0);
      p.bye = true;
    } else if (h.type == uint8_t(FrameType::ERROR)) {
      p.recv_active = false;
      p.rhdr_done = 0;
      pump_recv(p);  // reads and raises the peer's message
    }
  }
}

void Links::close_all(double deadline) {
  for (auto& p : peers_) {
    if (p.fd < 0) continue;
    if (!p.send_active) {
      FrameHeader h{};
      h.magic = kFrameMagic;
      h.type = uint8_t(FrameType::BYE);
      h.src_rank = uint32_t(topo_.rank);
      write_all(p.fd, &h, sizeof(h), deadline);
    }
    ::close(p.fd);
    p.fd = -1;
  }
}

}  // namespace sdp
