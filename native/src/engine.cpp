#include "sdp/engine.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "sdp/reduce.h"

namespace sdp {

namespace {
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

Engine::Engine(EngineConfig cfg)
    : cfg_(std::move(cfg)), topo_(cfg_.rank, cfg_.node_of_rank), links_(topo_, *this), shm_(topo_, *this),
      colls_(topo_, *this, links_, shm_) {
  if (topo_.local_size() > kMaxLocal) throw Error("at most 256 ranks per node are supported");
  if (cfg_.chunk_bytes < 4096) cfg_.chunk_bytes = 4096;
  cfg_.chunk_bytes = round_up(cfg_.chunk_bytes, 64);
  timeout_s = cfg_.timeout_s;
  // Measured on 2 cores with 2 ranks training (docs/benchmarks.md): spinning, then yielding,
  // beat going to sleep early, even though the machine is oversubscribed: a sleeping rank
  // pays a wake-up and a trip through the run queue on every barrier (and on every frame
  // awaited over TCP: the links poll before they sleep too).
  shm_.configure(cfg_.chunk_bytes, cfg_.spin >= 0 ? cfg_.spin : 2000);
  links_.set_spin(cfg_.spin != 0);
  colls_.configure(cfg_.chunk_bytes, int(env_int("SDP_PIPELINE_DEPTH", 2, 1, 2)));
  local_fds_.assign(size_t(local_size()), -1);
  local_gone_.assign(size_t(local_size()), false);
}

Engine::~Engine() {
  try { shutdown(); } catch (...) {}
}

std::pair<int, std::string> Engine::prepare() {
  if (is_leader()) {
    if (local_size() > 1) shm_.create();
    if (num_nodes() > 1 || local_size() > 1) {
      listen_fd_ = listen_on(cfg_.bind_addr, &port_);
      acceptor_ = std::thread([this] {
        name_this_thread("sdp-accept");
        acceptor_loop();
      });
    }
  }
  return {port_, shm_.name()};
}

void Engine::acceptor_loop() {
  serve_handshakes(
      listen_fd_, cfg_.secret, cfg_.rank,
      [this] {
        std::lock_guard<std::mutex> g(mu_);
        return stopping_ || setup_done_.load();
      },
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

void Engine::accept_peers(double setup_deadline) {
  // Leader: takes the authenticated connections of the lower nodes' leaders and of this node's
  // other ranks (offering each the node's shared memory) until every one has arrived.
  int L = local_size(), me = topo_.node;
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
        log_warning("rank " + std::to_string(cfg_.rank) + " dropped a connection claiming to be rank " +
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
      throw Error("timed out after " + fmt_seconds(cfg_.timeout_s) + " s waiting for rank(s) " + Topology::ranks_list(missing) +
                  " to connect to rank " + std::to_string(cfg_.rank));
    }
  }
}

void Engine::connect(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  int N = num_nodes(), L = local_size(), me = topo_.node;
  if (int(addrs.size()) != N || int(ports.size()) != N) throw Error("connect: need one leader address per node");
  double setup_deadline = now_s() + cfg_.timeout_s;
  topo_.node_addrs = addrs;
  PeerIdentity id{is_leader() ? Role::NODE : Role::LOCAL, uint32_t(me), uint32_t(topo_.local), uint32_t(cfg_.rank)};
  if (!is_leader()) {
    leader_fd_ = connect_to(addrs[me], ports[me], cfg_.secret, id, setup_deadline);
    // The segment to map comes over the authenticated link, never from the store.
    shm_.map_offered(leader_fd_, setup_deadline);
    char mapped = 'M';
    if (!write_all(leader_fd_, &mapped, 1, setup_deadline)) throw Error("the node leader closed the connection during set-up");
    set_nonblocking(leader_fd_);
    set_link_liveness(leader_fd_, cfg_.timeout_s);
  } else {
    // Connect to the leaders of higher nodes; lower nodes and our own local ranks connect to us.
    for (int n = me + 1; n < N; ++n) {
      Peer& p = links_[n];
      p.fd = connect_to(addrs[n], ports[n], cfg_.secret, id, setup_deadline);
      p.node = n;
      p.rank = topo_.leader_of(n);
    }
    accept_peers(setup_deadline);
    setup_done_.store(true);
    links_.start(cfg_.timeout_s);
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
  colls_.start();
  connected_ = true;
  progress_ = std::thread([this] {
    name_this_thread("sdp-progress");
    progress_loop();
  });
}

uint64_t Engine::submit(Coll c, void* buf, size_t count, DType t, ReduceOp op, int root, const void* src,
                        std::vector<char*> blocks) {
  if (root < 0 || root >= world_size()) throw Error("root " + std::to_string(root) + " is not a rank of this group");
  if (c == Coll::GATHER && num_nodes() > 1)
    throw Error("gather runs in the engine only when every rank of the group is on one node (across nodes, "
                "send the blocks to the root as messages)");
  if (c == Coll::ALLTOALL && !src) throw Error("all_to_all needs its input buffer");
  if ((c == Coll::GATHER || c == Coll::SCATTER) && rank() == root && blocks.size() != size_t(world_size()))
    throw Error(std::string(coll_name(c)) + " on the root needs one buffer per rank");
  std::lock_guard<std::mutex> g(mu_);
  if (!connected_) throw Error("engine is not connected");
  if (stopping_) throw Error("the process group has been shut down");
  uint64_t id = next_id_++;
  queue_.push_back(Work{id, c, static_cast<char*>(buf), count, t, op, root, static_cast<const char*>(src), std::move(blocks)});
  work_cv_.notify_one();
  return id;
}

void Engine::wait(uint64_t h, double wait_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto finished = [&] { return completed_ >= h || (failed_from_ && h >= failed_from_) || stopping_; };
  auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                       std::chrono::duration<double>(wait_s > 0 ? wait_s : 1e9));
  while (!finished()) {
    // The waiting thread runs queued work itself when the progress thread is not busy: a
    // blocking call then costs no thread hand-off (it matters for small collectives).
    if (!busy_ && !queue_.empty() && queue_.front().id <= h) {
      execute_front(lk);
      continue;
    }
    if (done_cv_.wait_until(lk, until) == std::cv_status::timeout && !finished())
      throw Error("timed out after " + fmt_seconds(wait_s) + " s waiting for collective handle " + std::to_string(h));
  }
  if (failed_from_ && h >= failed_from_) throw Error(broken_);
  if (completed_ < h) throw Error("the process group was shut down before this collective ran");
}

bool Engine::test(uint64_t h) {
  std::lock_guard<std::mutex> g(mu_);
  if (failed_from_ && h >= failed_from_) throw Error(broken_);
  return completed_ >= h;
}

std::string Engine::broken_message() {
  std::lock_guard<std::mutex> g(mu_);
  return broken_;
}

Stats Engine::stats() {
  std::lock_guard<std::mutex> g(mu_);
  Stats s = stats_;
  s.peer_read_bytes = colls_.peer_read_bytes();
  return s;
}

void Engine::execute_front(std::unique_lock<std::mutex>& lk) {
  // Called with mu_ held and busy_ false; runs the first queued collective with mu_ released.
  busy_ = true;
  Work w = queue_.front();
  bool already_broken = failed_from_ != 0;
  lk.unlock();
  // A failure is a flag, never "a non-empty message": an error whose text was lost (an empty
  // exception message, a peer's ERROR frame without a body) must still fail the collective.
  bool failed = false;
  std::string err;
  double t0 = now_s();
  if (!already_broken) {
    try {
      run(w);
    } catch (const Error& e) {
      failed = true;
      err = e.what();
    } catch (const std::exception& e) {
      failed = true;
      err = std::string("internal error: ") + e.what();
    } catch (...) {
      failed = true;
    }
  }
  lk.lock();
  busy_ = false;
  queue_.pop_front();
  if (failed && !failed_from_) {
    failed_from_ = w.id;
    broken_ = err.empty() ? "rank " + std::to_string(cfg_.rank) + ": " + desc() + " failed (its message was lost)" : err;
  }
  running = nullptr;
  if (!failed_from_) {
    completed_ = w.id;
    stats_.collectives++;
    stats_.bytes += w.count * dtype_size(w.dtype);
    stats_.busy_s += now_s() - t0;
  }
  done_cv_.notify_all();
  work_cv_.notify_all();
}

void Engine::progress_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!busy_ && !queue_.empty()) {
      execute_front(lk);
      continue;
    }
    if (stopping_ && queue_.empty()) return;
    work_cv_.wait_for(lk, std::chrono::milliseconds(20));
    if (busy_ || !queue_.empty() || stopping_ || failed_from_) continue;
    // Idle: notice dead ranks and error frames early, so the next call fails fast.
    busy_ = true;
    lk.unlock();
    bool failed = false;
    std::string err;
    try { idle_check(); } catch (const Error& e) { failed = true; err = e.what(); } catch (...) { failed = true; }
    lk.lock();
    busy_ = false;
    if (failed && !failed_from_) {
      failed_from_ = next_id_;
      broken_ = err.empty() ? "rank " + std::to_string(cfg_.rank) + " failed between collectives (its message was lost)" : err;
    }
    done_cv_.notify_all();
    work_cv_.notify_all();
  }
}

void Engine::run(const Work& w) {
  seq++;
  running = &w;
  deadline = now_s() + cfg_.timeout_s;
  if (world_size() == 1) return colls_.one_rank(w);
  switch (w.coll) {
    case Coll::ALLREDUCE: colls_.all_reduce(w); break;
    case Coll::BROADCAST: colls_.broadcast(w); break;
    case Coll::ALLGATHER: colls_.all_gather(w); break;
    case Coll::REDUCE_SCATTER: colls_.reduce_scatter(w); break;
    case Coll::GATHER: colls_.gather(w); break;
    case Coll::SCATTER: colls_.scatter(w); break;
    case Coll::ALLTOALL: colls_.all_to_all(w); break;
  }
}

// ---------------------------------------------------------------- the first-error latch

void Engine::fail(const std::string& msg, bool remote) {
  std::string final_msg = shm_.active() ? shm_.latch_error(msg, &remote) : msg;
  if (final_msg.empty()) final_msg = "rank " + std::to_string(cfg_.rank) + " failed in " + desc() + " (its message was lost)";
  if (is_leader() && !remote) links_.send_error_frames(final_msg);
  throw Error(final_msg);
}

void Engine::check_health() {
  std::string m;
  bool remote = false;
  if (shm_.published_error(&m, &remote)) {
    if (is_leader() && !remote) links_.send_error_frames(m);
    throw Error(m);
  }
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
    bool clean = gone_flag && *gone_flag;
    fail(topo_.rank_name(who_rank) + (clean ? " had shut down its process group" : " exited or closed its connection") +
         (running ? " during " + desc() : std::string(" while this rank was idle")));
  };
  if (is_leader()) {
    for (int l = 1; l < local_size(); ++l) {
      bool gone = local_gone_[l];
      probe(local_fds_[l], topo_.ranks_of_node[topo_.node][l], &gone);
      local_gone_[l] = gone;
    }
  } else {
    probe(leader_fd_, topo_.leader_of(topo_.node), nullptr);
  }
}

void Engine::idle_check() {
  // Between collectives: notice dead ranks and error frames early, so the next call fails fast.
  // (running is null here, so an error says "while this rank was idle").
  check_health();
  if (is_leader()) links_.idle_check();
}

// ---------------------------------------------------------------- shutdown

void Engine::shutdown() {
  // One shutdown at a time: Python may call it from a process group's destroy and from the
  // engine's finalizer on another thread; two joins of one std::thread are undefined behaviour.
  std::lock_guard<std::mutex> once(shutdown_mu_);
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_ && !progress_.joinable() && !acceptor_.joinable()) return;
    // Let queued collectives finish (or fail) before stopping.
    double until = now_s() + std::min(cfg_.timeout_s, 30.0);
    while (!queue_.empty() && !failed_from_ && now_s() < until) done_cv_.wait_for(lk, std::chrono::milliseconds(50));
    stopping_ = true;
    work_cv_.notify_all();
    done_cv_.notify_all();
  }
  if (progress_.joinable()) progress_.join();
  if (acceptor_.joinable()) acceptor_.join();
  double bye_deadline = now_s() + 1.0;
  links_.close_all(bye_deadline);
  for (int& fd : local_fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  if (leader_fd_ >= 0) {
    char b = 'B';
    write_all(leader_fd_, &b, 1, bye_deadline);
    ::close(leader_fd_);
    leader_fd_ = -1;
  }
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    if (listen_fd_ >= 0) {
      ::close(listen_fd_);
      listen_fd_ = -1;
    }
  }
  if (is_leader()) shm_.unlink();  // set-up did not finish: the segment is still named
  shm_.unmap();
}

}  // namespace sdp
