// The engine's connections: set-up and liveness (see engine_setup.h).
#include "sdp/engine_setup.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace sdp {

int Connections::prepare(const std::string& bind_addr, PortRange ports) {
  if (topo_.is_leader()) {
    if (topo_.local_size() > 1) shm_.create();
    if (topo_.num_nodes() > 1 || topo_.local_size() > 1) {
      listen_fd_ = listen_on(bind_addr, &port_, ports);
      acceptor_ = std::thread([this] {
        name_this_thread("sdp-accept");
        acceptor_loop();
      });
    }
  }
  return port_;
}

void Connections::acceptor_loop() {
  serve_handshakes(
      listen_fd_, secret_, topo_.rank, [this] { return stopping_.load() || setup_done_.load(); },
      [this](const PeerIdentity& who, int fd) {
        std::lock_guard<std::mutex> g(accept_mu_);
        accepted_.push_back({who, fd});
        accept_cv_.notify_all();
      });
  // Nobody may connect once set-up is done (or the engine stops).
  std::lock_guard<std::mutex> g(accept_mu_);
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void Connections::accept_peers(double setup_deadline) {
  // Leader: takes the authenticated connections of the lower nodes' leaders and of this node's
  // other ranks (offering each the node's shared memory) until every one has arrived.
  int L = topo_.local_size(), me = topo_.node;
  int expected = me + (L - 1);
  int got = 0;
  std::unique_lock<std::mutex> lk(accept_mu_);
  while (got < expected) {
    for (auto& [who, fd] : accepted_) {
      bool ok = false;
      // Claimed indices are checked against the layout before any is used as an index.
      if (who.role == Role::NODE && who.node < uint32_t(me) && links_[int(who.node)].fd < 0 &&
          who.rank == uint32_t(topo_.leader_of(int(who.node)))) {
        Peer& p = links_[int(who.node)];
        p.fd = fd;
        p.node = int(who.node);
        p.rank = int(who.rank);
        ok = true;
      } else if (who.role == Role::LOCAL && who.node == uint32_t(me) && who.local_rank > 0 && who.local_rank < uint32_t(L) &&
                 local_fds_[who.local_rank] < 0 && who.rank == uint32_t(topo_.ranks_of_node[me][who.local_rank])) {
        ShmOffer off = shm_.offer();
        ok = write_all(fd, &off, sizeof(off), setup_deadline);
        if (ok) local_fds_[who.local_rank] = fd;
      }
      if (ok) {
        ++got;
      } else {
        log_warning("rank " + std::to_string(topo_.rank) + " dropped a connection claiming to be rank " +
                    std::to_string(who.rank) + " that it did not expect");
        ::close(fd);
      }
    }
    accepted_.clear();
    if (got >= expected) break;
    if (accept_cv_.wait_until(lk, std::chrono::steady_clock::now() + std::chrono::milliseconds(200)) ==
            std::cv_status::timeout &&
        now_s() > setup_deadline) {
      std::vector<int> missing;
      for (int n = 0; n < me; ++n)
        if (links_[n].fd < 0) missing.push_back(topo_.leader_of(n));
      for (int l = 1; l < L; ++l)
        if (local_fds_[l] < 0) missing.push_back(topo_.ranks_of_node[me][l]);
      throw Error("timed out after " + fmt_seconds(timeout_s_) + " s waiting for rank(s) " + Topology::ranks_list(missing) +
                  " to connect to rank " + std::to_string(topo_.rank));
    }
  }
}

void Connections::connect(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  int N = topo_.num_nodes(), L = topo_.local_size(), me = topo_.node;
  if (int(addrs.size()) != N || int(ports.size()) != N) throw Error("connect: need one leader address per node");
  double setup_deadline = now_s() + timeout_s_;
  topo_.node_addrs = addrs;
  PeerIdentity id{topo_.is_leader() ? Role::NODE : Role::LOCAL, uint32_t(me), uint32_t(topo_.local), uint32_t(topo_.rank)};
  if (!topo_.is_leader()) {
    leader_fd_ = connect_to(addrs[me], ports[me], secret_, id, setup_deadline);
    // The segment to map comes over the authenticated link, never from the store.
    shm_.map_offered(leader_fd_, setup_deadline);
    char mapped = 'M';
    if (!write_all(leader_fd_, &mapped, 1, setup_deadline)) throw Error("the node leader closed the connection during set-up");
    set_nonblocking(leader_fd_);
    set_link_liveness(leader_fd_, timeout_s_);
  } else {
    // Connect to the leaders of higher nodes; lower nodes and our own local ranks connect to us.
    for (int n = me + 1; n < N; ++n) {
      Peer& p = links_[n];
      p.fd = connect_to(addrs[n], ports[n], secret_, id, setup_deadline);
      p.node = n;
      p.rank = topo_.leader_of(n);
    }
    accept_peers(setup_deadline);
    setup_done_.store(true);
    links_.start(timeout_s_);
    for (int fd : local_fds_)
      if (fd >= 0) set_nonblocking(fd);
    // Unlink once every local rank has mapped the segment ('M'): nothing is left in /dev/shm
    // even if the whole job is killed later.
    for (int l = 1; l < L; ++l) {
      char c = 0;
      if (!read_all(local_fds_[l], &c, 1, setup_deadline) || c != 'M')
        throw Error(topo_.rank_name(topo_.ranks_of_node[me][l]) + " did not map the node's shared memory before the deadline");
    }
    shm_.unlink();
  }
}

void Connections::check_local_ranks(const std::function<bool()>* settled) {
  auto probe = [&](int fd, int who_rank, bool* gone_flag) {
    if (fd < 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return;
    char c;
    ssize_t n = ::recv(fd, &c, 1, MSG_PEEK);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n == 1 && c == 'B') {  // a clean goodbye from a rank that shut down its process group
      ::recv(fd, &c, 1, 0);
      if (gone_flag) *gone_flag = true;
      return;
    }
    if (n == 1) return;
    // Gone, but the wait that asked may be over: then nothing is failed, latched or sent.
    if (settled && (*settled)()) return;
    bool clean = *gone_flag;
    // A rank that shut down its process group cleanly fails only a collective that runs while it is
    // gone: between collectives this rank may have nothing left that needs it (a scatter from
    // another node's root reaches a node's ranks as messages, and their leader may be done first).
    if (clean && !op_.running) return;
    op_.fail(topo_.rank_name(who_rank) + (clean ? " had shut down its process group" : " exited or closed its connection") +
             (op_.running ? " during " + op_.desc() : std::string(" while this rank was idle")));
  };
  if (topo_.is_leader()) {
    for (int l = 1; l < topo_.local_size(); ++l) {
      bool gone = local_gone_[l];
      probe(local_fds_[l], topo_.ranks_of_node[topo_.node][l], &gone);
      local_gone_[l] = gone;
    }
  } else {
    bool gone = leader_gone_;
    probe(leader_fd_, topo_.leader_of(topo_.node), &gone);
    leader_gone_ = gone;
  }
}

void Connections::close(double bye_deadline) {
  stopping_.store(true);
  if (acceptor_.joinable()) acceptor_.join();
  links_.close_all(bye_deadline);
  char b = 'B';  // goodbye: this rank shut down its process group (not a crash)
  for (int& fd : local_fds_) {
    if (fd >= 0) {
      write_all(fd, &b, 1, bye_deadline);
      ::close(fd);
    }
    fd = -1;
  }
  if (leader_fd_ >= 0) {
    write_all(leader_fd_, &b, 1, bye_deadline);
    ::close(leader_fd_);
    leader_fd_ = -1;
  }
  std::lock_guard<std::mutex> g(accept_mu_);
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

}  // namespace sdp
