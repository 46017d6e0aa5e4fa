#include "sdp/engine.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sched.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "sdp/hmac.h"
#include "sdp/reduce.h"

namespace sdp {

constexpr int kMaxLocal = 256;
// All-reduces up to this size within one node take a one-barrier path: every rank sums all
// slots itself, alternating between two slot sets so no second barrier is needed.
constexpr size_t kSmallBytes = 64 << 10;
constexpr uint32_t kShmMagic = 0x4d484453;  // "SDHM"

// Description of the collective a local rank is about to run, compared across the node.
struct CollDesc {
  uint64_t seq;
  uint64_t count;
  uint32_t root;
  uint8_t coll, dtype, op, valid;
};

struct ShmHeader {
  uint32_t magic;
  uint32_t local_size;
  uint64_t chunk_bytes;
  alignas(64) std::atomic<uint64_t> arrivals;
  alignas(64) std::atomic<uint32_t> wake;  // futex word, bumped by the last rank into a barrier
  std::atomic<uint32_t> sleepers;          // ranks asleep (or about to be) on `wake`
  alignas(64) std::atomic<uint32_t> error_state;  // 0 none, 1 being written, 2 published
  uint32_t error_remote;                          // 1: the error came from another node
  uint32_t error_rank;                            // global rank that published the error
  char error_msg[2048];
  uint8_t token[16];  // random; a local rank maps the segment only if it matches the leader's offer
  alignas(64) std::atomic<uint64_t> rank_arrivals[kMaxLocal];
  CollDesc desc[3][kMaxLocal];  // [0], [1]: alternate sets of the one-barrier path; [2]: the others
};

namespace {

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

void futex_wait(std::atomic<uint32_t>* addr, uint32_t val, int timeout_us) {
  timespec ts{timeout_us / 1000000, (timeout_us % 1000000) * 1000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, val, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A spin-wait hint: pause on x86, yield on ARM, nothing where neither exists (or in a portable build).
inline void cpu_relax() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(SDP_NO_INTRINSICS)
  __builtin_ia32_pause();
#elif defined(__aarch64__) && !defined(SDP_NO_INTRINSICS)
  asm volatile("yield");
#endif
}

// What a node leader sends each local rank over their authenticated connection: which
// segment to map, how big it must be, and the token it must hold. Nothing of this goes through
// the rendezvous store, so a stranger cannot point a rank at a segment of its own making.
#pragma pack(push, 1)
struct ShmOffer {
  uint32_t magic;
  char name[64];
  uint8_t token[16];
  uint64_t size;
};
#pragma pack(pop)
constexpr uint32_t kOfferMagic = 0x4f504453;  // "SDPO"

// Segments are named /sdp-<leader pid>-<random>. A leader killed during set-up (before every
// local rank mapped the segment and it was unlinked) leaves one behind: the next leader of this
// user removes those whose process is gone.
void remove_stale_segments() {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  while (dirent* e = readdir(d)) {
    int pid = 0;
    char rest[64];
    if (std::sscanf(e->d_name, "sdp-%d-%63s", &pid, rest) != 2 || pid <= 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st{};
    std::string path = std::string("/dev/shm/") + e->d_name;
    if (::lstat(path.c_str(), &st) == 0 && st.st_uid == ::geteuid()) shm_unlink((std::string("/") + e->d_name).c_str());
  }
  closedir(d);
}

std::string fmt_seconds(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

Engine::Engine(EngineConfig cfg) : cfg_(std::move(cfg)) {
  int w = int(cfg_.node_of_rank.size());
  if (w <= 0) throw Error("world size must be at least 1");
  if (cfg_.rank < 0 || cfg_.rank >= w) throw Error("rank " + std::to_string(cfg_.rank) + " outside world of " + std::to_string(w));
  int nn = 0;
  for (int n : cfg_.node_of_rank) {
    if (n < 0) throw Error("negative node index");
    nn = std::max(nn, n + 1);
  }
  ranks_of_node_.assign(nn, {});
  for (int r = 0; r < w; ++r) ranks_of_node_[cfg_.node_of_rank[r]].push_back(r);
  for (int n = 0; n < nn; ++n)
    if (ranks_of_node_[n].empty()) throw Error("node " + std::to_string(n) + " has no ranks: node indices must be 0..N-1");
  node_ = cfg_.node_of_rank[cfg_.rank];
  auto& mine = ranks_of_node_[node_];
  local_ = int(std::find(mine.begin(), mine.end(), cfg_.rank) - mine.begin());
  if (int(mine.size()) > kMaxLocal) throw Error("at most 256 ranks per node are supported");
  if (cfg_.chunk_bytes < 4096) cfg_.chunk_bytes = 4096;
  // Measured on 2 cores with 2 ranks training (docs/benchmarks.md): spinning, then yielding,
  // beat going to sleep early, even though the machine is oversubscribed: a sleeping rank
  // pays a wake-up and a trip through the run queue on every barrier.
  spin_ = cfg_.spin >= 0 ? cfg_.spin : 2000;
  pipeline_depth_ = int(env_int("SDP_PIPELINE_DEPTH", 2, 1, 2));
  yield_ = spin_ > 0;
  cfg_.chunk_bytes = round_up(cfg_.chunk_bytes, 64);
  peers_.resize(nn);
  local_fds_.assign(mine.size(), -1);
  local_gone_.assign(mine.size(), false);
}

Engine::~Engine() {
  try { shutdown(); } catch (...) {}
}

std::string Engine::rank_name(int r) const {
  int n = cfg_.node_of_rank[r];
  std::string s = "rank " + std::to_string(r) + " (node " + std::to_string(n);
  // Ranks of other nodes are named with their host's address too: "the host is unreachable"
  // is what a user needs to know when a link fails.
  if (n != node_ && size_t(n) < node_addrs_.size() && !node_addrs_[n].empty()) s += " at " + node_addrs_[n];
  return s + ")";
}

std::string Engine::ranks_list(const std::vector<int>& ranks) const {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

char* Engine::slot(int local) const { return shm_data_ + size_t(local) * cfg_.chunk_bytes; }
char* Engine::red_area() const { return slot(local_size()); }
char* Engine::small_slot(int set, int local) const {
  return slot(local_size() + 1) + (size_t(set) * size_t(local_size()) + size_t(local)) * kSmallBytes;
}

std::pair<int, std::string> Engine::prepare() {
  int L = local_size();
  if (is_leader()) {
    if (L > 1) {
      remove_stale_segments();
      uint8_t rnd[8];
      random_bytes(rnd, sizeof(rnd));
      char name[64];
      std::snprintf(name, sizeof(name), "/sdp-%d-%02x%02x%02x%02x%02x%02x", getpid(), rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
      shm_name_ = name;
      size_t hdr = round_up(sizeof(ShmHeader), 4096);
      shm_size_ = hdr + size_t(L + 1) * cfg_.chunk_bytes + 2 * size_t(L) * kSmallBytes;
      int fd = shm_open(shm_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) throw Error("cannot create shared memory " + shm_name_ + ": " + std::strerror(errno));
      if (ftruncate(fd, off_t(shm_size_)) != 0) {
        ::close(fd);
        shm_unlink(shm_name_.c_str());
        throw Error("cannot size shared memory (" + std::to_string(shm_size_) + " bytes): " + std::strerror(errno) +
                    " (is /dev/shm large enough? lower SDP_CHUNK_BYTES)");
      }
      void* p = mmap(nullptr, shm_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      ::close(fd);
      if (p == MAP_FAILED) {
        shm_unlink(shm_name_.c_str());
        throw Error(std::string("cannot map shared memory: ") + std::strerror(errno));
      }
      std::memset(p, 0, shm_size_);  // touch every page once, now, not during the first collective
      shm_ = new (p) ShmHeader();
      shm_->magic = kShmMagic;
      shm_->local_size = uint32_t(L);
      shm_->chunk_bytes = cfg_.chunk_bytes;
      random_bytes(shm_->token, sizeof(shm_->token));
      shm_data_ = static_cast<char*>(p) + hdr;
    }
    if (num_nodes() > 1 || L > 1) {
      listen_fd_ = listen_on(cfg_.bind_addr, &port_);
      acceptor_ = std::thread([this] { acceptor_loop(); });
    }
  }
  return {port_, shm_name_};
}

void Engine::acceptor_loop() {
  // Handshakes run here, many at once, each a few bytes at a time with its own deadline: a
  // stranger that connects and sends nothing delays nobody, and at most kMaxPending
  // unauthenticated sockets are held (the oldest is dropped for a new one). The listener is
  // closed as soon as set-up is done: after that nobody has a reason to connect.
  constexpr size_t kMaxPending = 32;
  constexpr double kHandshakeSeconds = 5.0;
  std::deque<ServerHandshake> pending;
  auto drop = [&](ServerHandshake& h, const std::string& why) {
    log_warning("rank " + std::to_string(cfg_.rank) + " dropped a connection from " + peer_address(h.fd()) + ": it " + why);
    ::close(h.fd());
  };
  std::vector<pollfd> pfds;
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopping_) break;
    }
    if (setup_done_.load()) break;
    pfds.clear();
    pfds.push_back({listen_fd_, POLLIN, 0});
    for (auto& h : pending) pfds.push_back({h.fd(), POLLIN, 0});
    int r = ::poll(pfds.data(), nfds_t(pfds.size()), 100);
    if (r < 0 && errno != EINTR) break;
    if (pfds[0].revents & POLLIN) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        if (pending.size() >= kMaxPending) {
          drop(pending.front(), "was still unauthenticated when newer connections came");
          pending.pop_front();
        }
        pending.emplace_back(fd, now_s() + kHandshakeSeconds);
      }
    }
    for (auto it = pending.begin(); it != pending.end();) {
      PeerIdentity who{};
      std::string why;
      int st = it->step(cfg_.secret, &who, &why);
      if (st == 0) { ++it; continue; }
      if (st < 0) {
        drop(*it, why);
      } else {
        std::lock_guard<std::mutex> g(accept_mu_);
        accepted_.push_back({who, it->fd()});
        accept_cv_.notify_all();
      }
      it = pending.erase(it);
    }
  }
  for (auto& h : pending) ::close(h.fd());
  // Nobody may connect once set-up is done (or the engine stops).
  std::lock_guard<std::mutex> g(accept_mu_);
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void Engine::connect(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  int N = num_nodes(), L = local_size();
  if (int(addrs.size()) != N || int(ports.size()) != N) throw Error("connect: need one leader address per node");
  double deadline = now_s() + cfg_.timeout_s;
  node_addrs_ = addrs;
  PeerIdentity me{is_leader() ? Role::NODE : Role::LOCAL, uint32_t(node_), uint32_t(local_), uint32_t(cfg_.rank)};
  if (!is_leader()) {
    leader_fd_ = connect_to(addrs[node_], ports[node_], cfg_.secret, me, deadline);
    // The segment to map comes over the authenticated link, never from the store; it is used
    // only if it is this user's, private, exactly the offered size, and holds the offered token.
    ShmOffer off{};
    if (!read_all(leader_fd_, &off, sizeof(off), deadline) || off.magic != kOfferMagic)
      throw Error("the node leader " + rank_name(ranks_of_node_[node_][0]) + " did not offer its shared memory before the deadline");
    off.name[sizeof(off.name) - 1] = 0;
    if (std::strncmp(off.name, "/sdp-", 5) != 0 || std::strchr(off.name + 1, '/'))
      throw Error("protocol error: the node leader offered a bad shared-memory name");
    int fd = shm_open(off.name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0) throw Error(std::string("cannot open the node's shared memory ") + off.name + ": " + std::strerror(errno));
    struct stat st{};
    if (fstat(fd, &st) != 0 || st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600 || uint64_t(st.st_size) != off.size ||
        off.size < round_up(sizeof(ShmHeader), 4096)) {
      ::close(fd);
      throw Error(std::string("refusing the node's shared memory ") + off.name +
                  ": not a 0600 segment of this user of the offered size (tampered with?)");
    }
    shm_size_ = size_t(off.size);
    void* p = mmap(nullptr, shm_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw Error(std::string("cannot map the node's shared memory: ") + std::strerror(errno));
    shm_ = static_cast<ShmHeader*>(p);
    if (shm_->magic != kShmMagic || std::memcmp(shm_->token, off.token, sizeof(off.token)) != 0)
      throw Error("refusing the node's shared memory: it does not hold the token its leader offered");
    if (int(shm_->local_size) != L || shm_->chunk_bytes != cfg_.chunk_bytes)
      throw Error("the node's shared memory was made for another layout (SDP_CHUNK_BYTES differs between ranks?)");
    shm_data_ = static_cast<char*>(p) + round_up(sizeof(ShmHeader), 4096);
    char mapped = 'M';
    if (!write_all(leader_fd_, &mapped, 1, deadline)) throw Error("the node leader closed the connection during set-up");
    set_nonblocking(leader_fd_);
    set_link_liveness(leader_fd_, cfg_.timeout_s);
  } else {
    // Connect to the leaders of higher nodes; lower nodes and our own local ranks connect to us.
    for (int n = node_ + 1; n < N; ++n) {
      peers_[n].fd = connect_to(addrs[n], ports[n], cfg_.secret, me, deadline);
      peers_[n].node = n;
      peers_[n].rank = ranks_of_node_[n][0];
    }
    int expected = node_ + (L - 1);
    int got = 0;
    std::unique_lock<std::mutex> lk(accept_mu_);
    while (got < expected) {
      for (auto& [who, fd] : accepted_) {
        bool ok = false;
        // Claimed indices are checked against the layout before any is used as an index.
        if (who.role == Role::NODE && who.node < uint32_t(node_) && peers_[who.node].fd < 0 &&
            who.rank == uint32_t(ranks_of_node_[who.node][0])) {
          peers_[who.node].fd = fd;
          peers_[who.node].node = int(who.node);
          peers_[who.node].rank = int(who.rank);
          ok = true;
        } else if (who.role == Role::LOCAL && who.node == uint32_t(node_) && who.local_rank > 0 &&
                   who.local_rank < uint32_t(L) && local_fds_[who.local_rank] < 0 &&
                   who.rank == uint32_t(ranks_of_node_[node_][who.local_rank])) {
          ShmOffer off{};
          off.magic = kOfferMagic;
          std::snprintf(off.name, sizeof(off.name), "%s", shm_name_.c_str());
          std::memcpy(off.token, shm_->token, sizeof(off.token));
          off.size = shm_size_;
          ok = write_all(fd, &off, sizeof(off), deadline);
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
          now_s() > deadline) {
        std::vector<int> missing;
        for (int n = 0; n < node_; ++n)
          if (peers_[n].fd < 0) missing.push_back(ranks_of_node_[n][0]);
        for (int l = 1; l < L; ++l)
          if (local_fds_[l] < 0) missing.push_back(ranks_of_node_[node_][l]);
        throw Error("timed out after " + fmt_seconds(cfg_.timeout_s) + " s waiting for rank(s) " + ranks_list(missing) +
                    " to connect to rank " + std::to_string(cfg_.rank));
      }
    }
    lk.unlock();
    setup_done_.store(true);
    for (auto& p : peers_)
      if (p.fd >= 0) {
        set_nonblocking(p.fd);
        set_bulk_buffers(p.fd);
        set_link_liveness(p.fd, cfg_.timeout_s);
      }
    for (int fd : local_fds_)
      if (fd >= 0) set_nonblocking(fd);
    // Unlink once every local rank has mapped the segment ('M'): nothing is left in /dev/shm
    // even if the whole job is killed later.
    for (int l = 1; l < L; ++l) {
      char c = 0;
      if (!read_all(local_fds_[l], &c, 1, deadline) || c != 'M')
        throw Error(rank_name(ranks_of_node_[node_][l]) + " did not map the node's shared memory before the deadline");
    }
    if (!shm_name_.empty()) shm_unlink(shm_name_.c_str());
    if (N > 1) recv_buf_.assign(2 * size_t(N) * recv_slot_bytes(), 0);  // two sets, touched once now
    if (N > 1 && L == 1) small_buf_.assign(size_t(N + 1) * kSmallBytes, 0);
  }
  srcs_.resize(std::max(L, N) + 1);
  connected_ = true;
  progress_ = std::thread([this] { progress_loop(); });
}

uint64_t Engine::submit(Coll c, void* buf, size_t count, DType t, ReduceOp op, int root) {
  if (root < 0 || root >= world_size()) throw Error("root " + std::to_string(root) + " is not a rank of this group");
  std::lock_guard<std::mutex> g(mu_);
  if (!connected_) throw Error("engine is not connected");
  if (stopping_) throw Error("the process group has been shut down");
  uint64_t id = next_id_++;
  queue_.push_back(Work{id, c, static_cast<char*>(buf), count, t, op, root});
  work_cv_.notify_one();
  return id;
}

void Engine::wait(uint64_t h, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto finished = [&] { return completed_ >= h || (failed_from_ && h >= failed_from_) || stopping_; };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 1e9));
  while (!finished()) {
    // The waiting thread runs queued work itself when the progress thread is not busy: a
    // blocking call then costs no thread hand-off (it matters for small collectives).
    if (!busy_ && !queue_.empty() && queue_.front().id <= h) {
      execute_front(lk);
      continue;
    }
    if (done_cv_.wait_until(lk, deadline) == std::cv_status::timeout && !finished())
      throw Error("timed out after " + fmt_seconds(timeout_s) + " s waiting for collective handle " + std::to_string(h));
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
  return stats_;
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
    broken_ = err.empty() ? "rank " + std::to_string(cfg_.rank) + ": " + cur_desc_ + " failed (its message was lost)" : err;
  }
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
  seq_++;
  std::ostringstream d;
  d << coll_name(w.coll) << " #" << seq_ << " (" << w.count << " x " << dtype_name(w.dtype);
  if (w.coll == Coll::ALLREDUCE) d << ", " << op_name(w.op);
  else d << ", root " << w.root;
  d << ")";
  cur_desc_ = d.str();
  op_deadline_ = now_s() + cfg_.timeout_s;
  if (world_size() == 1) {
    if (w.coll == Coll::ALLREDUCE && w.op == ReduceOp::AVG) copy_scaled(w.dtype, w.buf, w.buf, w.count, 1.0);
    return;
  }
  if (w.coll == Coll::ALLREDUCE) run_allreduce(w);
  else run_broadcast(w);
}

// ---------------------------------------------------------------- node-level synchronisation

void Engine::publish_desc(const Work& w, int set) {
  CollDesc& d = shm_->desc[set][local_];
  d.seq = seq_;
  d.count = w.count;
  d.root = uint32_t(w.root);
  d.coll = uint8_t(w.coll);
  d.dtype = uint8_t(w.dtype);
  d.op = uint8_t(w.op);
  d.valid = 1;
}

namespace {

// What two ranks said about the collective they are running.
struct Described {
  uint64_t seq, count;
  uint32_t root;
  uint8_t coll, dtype, op;
};

// The first field in which a and b differ, with both values in words; false if they agree.
bool first_difference(const Described& a, const Described& b, std::string* field, std::string* va, std::string* vb) {
  auto set = [&](const char* f, std::string x, std::string y) {
    *field = f;
    *va = std::move(x);
    *vb = std::move(y);
    return true;
  };
  if (a.seq != b.seq) return set("collective number", std::to_string(a.seq), std::to_string(b.seq));
  if (a.coll != b.coll) return set("collective", coll_name(Coll(a.coll)), coll_name(Coll(b.coll)));
  if (a.count != b.count) return set("element count", std::to_string(a.count), std::to_string(b.count));
  if (a.dtype != b.dtype) return set("dtype", dtype_name(DType(a.dtype)), dtype_name(DType(b.dtype)));
  if (a.coll == uint8_t(Coll::ALLREDUCE) && a.op != b.op)
    return set("reduce op", op_name(ReduceOp(a.op)), op_name(ReduceOp(b.op)));
  if (a.coll == uint8_t(Coll::BROADCAST) && a.root != b.root)
    return set("root", std::to_string(a.root), std::to_string(b.root));
  return false;
}

}  // namespace

void Engine::check_descs(const Work& w, int set) {
  // Every local rank runs the same comparison against the same data, so all of them fail together.
  const CollDesc& a = shm_->desc[set][0];
  int ra = ranks_of_node_[node_][0];
  for (int l = 1; l < local_size(); ++l) {
    const CollDesc& b = shm_->desc[set][l];
    int rb = ranks_of_node_[node_][l];
    std::string field, va, vb;
    first_difference(Described{a.seq, a.count, a.root, a.coll, a.dtype, a.op},
                     Described{b.seq, b.count, b.root, b.coll, b.dtype, b.op}, &field, &va, &vb);
    if (!field.empty())
      fail("collective mismatch at " + cur_desc_ + ": " + field + " differs: rank " + std::to_string(ra) + " has " + va +
           ", rank " + std::to_string(rb) + " has " + vb + "; nothing was reduced");
  }
  (void)w;
}

void Engine::node_barrier() {
  int L = local_size();
  uint64_t mine = ++barrier_count_;
  uint64_t target = mine * uint64_t(L);
  shm_->rank_arrivals[local_].store(mine, std::memory_order_release);
  uint64_t v = shm_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (v == target) {
    shm_->wake.fetch_add(1);
    // The wake-up is a system call: skip it when every peer is still spinning.
    if (shm_->sleepers.load() > 0) futex_wake_all(&shm_->wake);
    return;
  }
  // Wait in three stages: a short pause-spin (the peers are usually microseconds away), then
  // sched_yield for up to ~200 us, then a futex sleep that also checks health and the
  // deadline.
  for (int i = 0; i < spin_; ++i) {
    if (shm_->arrivals.load(std::memory_order_acquire) >= target) return;
    cpu_relax();
  }
  if (yield_) {
    double until = now_s() + 200e-6;
    do {
      for (int i = 0; i < 32; ++i) {
        if (shm_->arrivals.load(std::memory_order_acquire) >= target) return;
        sched_yield();
      }
    } while (now_s() < until);
  }
  struct Sleeping {  // counted while this rank may be inside futex_wait
    std::atomic<uint32_t>& n;
    explicit Sleeping(std::atomic<uint32_t>& c) : n(c) { n.fetch_add(1); }
    ~Sleeping() { n.fetch_sub(1); }
  } sleeping(shm_->sleepers);
  for (;;) {
    uint32_t w = shm_->wake.load();
    if (shm_->arrivals.load() >= target) return;
    check_health();
    if (now_s() > op_deadline_) {
      std::vector<int> late;
      for (int l = 0; l < L; ++l)
        if (shm_->rank_arrivals[l].load() < mine) late.push_back(ranks_of_node_[node_][l]);
      // Only the leader is late and it talks to other nodes: it is most likely waiting on the
      // network under the same deadline. Give it a moment to publish the better error (which
      // names the unreachable node) instead of blaming it.
      if (num_nodes() > 1 && late.size() == 1 && late[0] == ranks_of_node_[node_][0] &&
          now_s() < op_deadline_ + 2.0) {
        futex_wait(&shm_->wake, w, 2000);
        continue;
      }
      fail("timed out after " + fmt_seconds(cfg_.timeout_s) + " s in " + cur_desc_ + " waiting for rank(s) " +
           ranks_list(late) + " of node " + std::to_string(node_) + " (stalled or not calling this collective)");
    }
    futex_wait(&shm_->wake, w, 2000);
  }
}

// ---------------------------------------------------------------- health and errors

void Engine::fail(const std::string& msg, bool remote) {
  std::string final_msg = msg;
  if (shm_) {
    uint32_t expected = 0;
    if (shm_->error_state.compare_exchange_strong(expected, 1)) {
      std::snprintf(shm_->error_msg, sizeof(shm_->error_msg), "%s", msg.c_str());
      shm_->error_remote = remote ? 1 : 0;
      shm_->error_rank = uint32_t(cfg_.rank);
      shm_->error_state.store(2, std::memory_order_release);
      shm_->wake.fetch_add(1);
      futex_wake_all(&shm_->wake);
    } else {
      // Another local rank won the error slot: every rank reports the first error, so wait
      // (bounded: the winner may have died mid-write) until its message is published.
      double until = now_s() + 1.0;
      while (shm_->error_state.load(std::memory_order_acquire) != 2 && now_s() < until) sched_yield();
      if (shm_->error_state.load(std::memory_order_acquire) == 2) {
        final_msg = shm_->error_msg;
        remote = shm_->error_remote != 0;
        if (final_msg.empty())
          final_msg = "rank " + std::to_string(shm_->error_rank) + " reported an error (its message was lost)";
      }
    }
  }
  if (final_msg.empty()) final_msg = "rank " + std::to_string(cfg_.rank) + " failed in " + cur_desc_ + " (its message was lost)";
  if (is_leader() && !remote) send_error_frames(final_msg);
  throw Error(final_msg);
}

void Engine::send_error_frames(const std::string& msg) {
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
    h.src_rank = uint32_t(cfg_.rank);
    h.seq = seq_;
    h.nbytes = std::min<size_t>(msg.size(), 2000);
    if (write_all(p.fd, &h, sizeof(h), deadline)) write_all(p.fd, msg.data(), h.nbytes, deadline);
  }
}

void Engine::check_health() {
  if (shm_ && shm_->error_state.load(std::memory_order_acquire) == 2) {
    std::string m = shm_->error_msg;
    if (m.empty()) m = "rank " + std::to_string(shm_->error_rank) + " reported an error (its message was lost)";
    if (is_leader() && !shm_->error_remote) send_error_frames(m);
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
    fail(rank_name(who_rank) + (clean ? " had shut down its process group" : " exited or closed its connection") +
         (cur_desc_.empty() ? std::string(" while this rank was idle") : " during " + cur_desc_));
  };
  if (is_leader()) {
    for (int l = 1; l < local_size(); ++l) {
      bool gone = local_gone_[l];
      probe(local_fds_[l], ranks_of_node_[node_][l], &gone);
      local_gone_[l] = gone;
    }
  } else {
    probe(leader_fd_, ranks_of_node_[node_][0], nullptr);
  }
}

void Engine::idle_check() {
  // Between collectives: notice dead ranks and error frames early, so the next call fails fast.
  std::string saved = cur_desc_;
  cur_desc_.clear();
  try {
    check_health();
    if (is_leader()) {
      for (auto& p : peers_) {
        if (p.fd < 0 || p.bye) continue;
        FrameHeader h{};
        ssize_t n = ::recv(p.fd, &h, sizeof(h), MSG_PEEK);
        if (n < 0) {
          if (errno == EAGAIN || errno == EINTR) continue;
          fail(rank_name(p.rank) + " (leader of node " + std::to_string(p.node) + ") lost its connection while this rank was idle");
        }
        if (n == 0) fail(rank_name(p.rank) + " (leader of node " + std::to_string(p.node) + ") exited or closed its connection while this rank was idle");
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
  } catch (...) {
    cur_desc_ = saved;
    throw;
  }
  cur_desc_ = saved;
}

// ---------------------------------------------------------------- TCP exchange between node leaders

bool Engine::pump_send(Peer& p) {
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
      fail("connection to " + rank_name(p.rank) + " failed during " + cur_desc_ + " (" + std::strerror(errno) +
           "): that rank exited or its host is unreachable");
    }
    p.sdone += size_t(r);
    if (p.sdone == sizeof(FrameHeader) + p.slen) {
      p.send_active = false;
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

void Engine::check_frame(const Peer& p) {
  const FrameHeader& g = p.rhdr;
  const FrameHeader& e = p.expect;
  std::string field, va, vb;
  if (first_difference(Described{e.seq, e.count, e.root, e.coll, e.dtype, e.op},
                       Described{g.seq, g.count, g.root, g.coll, g.dtype, g.op}, &field, &va, &vb))
    fail("collective mismatch at " + cur_desc_ + ": " + field + " differs: rank " + std::to_string(cfg_.rank) + " has " + va +
         ", " + rank_name(p.rank) + " has " + vb + "; nothing was reduced");
  if (g.offset != e.offset || g.nbytes != e.nbytes)
    fail("protocol error in " + cur_desc_ + ": " + rank_name(p.rank) + " sent bytes " + std::to_string(g.offset) + "+" +
         std::to_string(g.nbytes) + " where " + std::to_string(e.offset) + "+" + std::to_string(e.nbytes) + " was expected");
}

bool Engine::pump_recv(Peer& p) {
  for (;;) {
    if (p.rhdr_done < sizeof(FrameHeader)) {
      ssize_t r = ::recv(p.fd, reinterpret_cast<char*>(&p.rhdr) + p.rhdr_done, sizeof(FrameHeader) - p.rhdr_done, 0);
      if (r == 0) fail(rank_name(p.rank) + " exited or closed its connection during " + cur_desc_);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
        fail("connection to " + rank_name(p.rank) + " failed during " + cur_desc_ + " (" + std::strerror(errno) + ")");
      }
      p.rhdr_done += size_t(r);
      if (p.rhdr_done < sizeof(FrameHeader)) continue;
      const FrameHeader& g = p.rhdr;
      if (g.magic != kFrameMagic)
        fail("protocol error: " + rank_name(p.rank) + " sent a malformed frame during " + cur_desc_);
      if (g.type == uint8_t(FrameType::ERROR)) {
        std::string m(std::min<uint64_t>(g.nbytes, 4096), '\0');
        if (m.empty() || !read_all(p.fd, m.data(), m.size(), now_s() + 2.0) || m.find_first_not_of('\0') == std::string::npos)
          m = "rank " + std::to_string(g.src_rank) + " reported an error (its message was lost)";
        // A peer's text becomes a Python exception message: printable ASCII only (bytes that are
        // not valid UTF-8 once turned the engine's error into a UnicodeDecodeError: the fuzzer's find).
        for (char& c : m)
          if ((c < 0x20 || c > 0x7e) && c != '\n' && c != '\t') c = '?';
        fail(m, /*remote=*/true);
      }
      if (g.type == uint8_t(FrameType::BYE)) {
        p.bye = true;
        fail(rank_name(p.rank) + " shut down its process group while this rank was in " + cur_desc_);
      }
      if (g.type != uint8_t(FrameType::DATA))
        fail("protocol error: " + rank_name(p.rank) + " sent an unknown frame type during " + cur_desc_);
      if (!p.recv_active)
        fail("protocol error: " + rank_name(p.rank) + " sent data this rank did not expect during " + cur_desc_);
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
    if (r == 0) fail(rank_name(p.rank) + " exited or closed its connection during " + cur_desc_);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      fail("connection to " + rank_name(p.rank) + " failed during " + cur_desc_ + " (" + std::strerror(errno) + ")");
    }
    p.rdone += size_t(r);
  }
}

void Engine::post_send(Peer& p, const FrameHeader& h, const char* data) {
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

void Engine::post_recv(Peer& p, const FrameHeader& expect, char* dst) {
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

void Engine::exchange(int scatter_set) {
  // Moves every posted frame until the scatter into receive set `scatter_set` has arrived from
  // every peer (with -1: until every posted frame, sends included, is done). Sockets are
  // non-blocking: a peer that cannot take more data never holds up the others.
  std::vector<pollfd> pfds;
  std::vector<Peer*> who;
  for (;;) {
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
    if (reached) return;
    if (pfds.empty()) fail("internal error in " + cur_desc_ + ": waiting for frames that were never posted");
    int r = ::poll(pfds.data(), nfds_t(pfds.size()), 50);
    if (r == 0 || (r < 0 && errno == EINTR)) {
      check_health();
      if (now_s() > op_deadline_) {
        std::string late;
        for (Peer* p : who) late += (late.empty() ? "" : ", ") + rank_name(p->rank);
        fail("timed out after " + fmt_seconds(cfg_.timeout_s) + " s in " + cur_desc_ + " waiting for node leader " + late +
             " (that host is unreachable or stalled, or a rank there is not calling this collective)");
      }
    }
  }
}

FrameHeader Engine::frame_base(const Work& w) const {
  FrameHeader base{};
  base.magic = kFrameMagic;
  base.type = uint8_t(FrameType::DATA);
  base.coll = uint8_t(w.coll);
  base.dtype = uint8_t(w.dtype);
  base.op = uint8_t(w.op);
  base.src_rank = uint32_t(cfg_.rank);
  base.root = uint32_t(w.root);
  base.seq = seq_;
  base.count = w.count;
  return base;
}

// Shard k of a chunk of n elements is [n*k/N, n*(k+1)/N): any n, shards differ by at most one.
static inline size_t shard_lo(size_t n, int k, int N) { return n * size_t(k) / size_t(N); }

// A shard of a chunk (plus slack for uneven splits), rounded to 64 bytes so every slot starts
// aligned for any element type (3 nodes and 4 KiB chunks once put slot 1 at an odd address:
// UBSan's misaligned-load report, found by the sanitizer run in tests/test_native_builds.py).
size_t Engine::recv_slot_bytes() const { return round_up(cfg_.chunk_bytes / size_t(num_nodes()) + 64, 64); }
// Where the shard from node k lands in receive set `set` (two sets, one per chunk in flight).
char* Engine::recv_slot(int set, int k) {
  return recv_buf_.data() + (size_t(set) * size_t(num_nodes()) + size_t(k)) * recv_slot_bytes();
}

void Engine::post_scatter(const FrameHeader& base, char* red, size_t off, size_t n, int set) {
  // Node k receives shard k of every node's chunk, into receive set `set` (two sets, so the
  // next chunk can arrive while this one is being reduced).
  int N = num_nodes();
  size_t esz = dtype_size(DType(base.dtype));
  size_t my_lo = shard_lo(n, node_, N), my_n = shard_lo(n, node_ + 1, N) - my_lo;
  for (int k = 0; k < N; ++k) {
    if (k == node_) continue;
    Peer& p = peers_[k];
    FrameHeader h = base;
    h.offset = off + shard_lo(n, k, N);
    h.nbytes = (shard_lo(n, k + 1, N) - shard_lo(n, k, N)) * esz;
    post_send(p, h, red + shard_lo(n, k, N) * esz);
    FrameHeader e = base;
    e.offset = off + my_lo;
    e.nbytes = my_n * esz;
    post_recv(p, e, recv_slot(set, k));
    p.scatter_mark[set] = p.recvs_posted;
  }
}

void Engine::reduce_shard(const Work& w, char* red, size_t n, int set) {
  int N = num_nodes();
  size_t esz = dtype_size(w.dtype);
  size_t my_lo = shard_lo(n, node_, N), my_n = shard_lo(n, node_ + 1, N) - my_lo;
  int ns = 0;
  srcs_[ns++] = red + my_lo * esz;
  for (int k = 0; k < N; ++k)
    if (k != node_) srcs_[ns++] = recv_slot(set, k);
  reduce_many(w.dtype, w.op, red + my_lo * esz, srcs_.data(), ns, my_n);
}

void Engine::post_gather(const FrameHeader& base, char* red, size_t off, size_t n) {
  // Every node gets every reduced shard, straight into place.
  int N = num_nodes();
  size_t esz = dtype_size(DType(base.dtype));
  size_t my_lo = shard_lo(n, node_, N), my_n = shard_lo(n, node_ + 1, N) - my_lo;
  for (int k = 0; k < N; ++k) {
    if (k == node_) continue;
    Peer& p = peers_[k];
    FrameHeader h = base;
    h.offset = off + my_lo;
    h.nbytes = my_n * esz;
    post_send(p, h, red + my_lo * esz);
    FrameHeader e = base;
    e.offset = off + shard_lo(n, k, N);
    e.nbytes = (shard_lo(n, k + 1, N) - shard_lo(n, k, N)) * esz;
    post_recv(p, e, red + shard_lo(n, k, N) * esz);
  }
}

void Engine::inter_node_allreduce(const Work& w, char* red, size_t off, size_t n) {
  // One chunk that lives in the node's shared memory (several ranks per node): scatter,
  // reduce, gather, in lockstep with the node's barriers.
  FrameHeader base = frame_base(w);
  post_scatter(base, red, off, n, 0);
  exchange(0);
  reduce_shard(w, red, n, 0);
  post_gather(base, red, off, n);
  exchange();
}

void Engine::small_tcp_allreduce(const Work& w, double divisor) {
  // Small all-reduce, one rank per node: every node sends its whole buffer to every other and
  // sums all of them itself. One exchange instead of scatter + gather halves the round trips
  // (latency is all that matters up to kSmallBytes). Every node sums in node order, so all of
  // them get the same bits.
  int N = num_nodes();
  size_t bytes = w.count * dtype_size(w.dtype);
  FrameHeader h = frame_base(w);
  h.offset = 0;
  h.nbytes = bytes;
  for (int k = 0; k < N; ++k) {
    if (k == node_) continue;
    post_send(peers_[k], h, w.buf);
    post_recv(peers_[k], h, small_buf_.data() + size_t(k) * kSmallBytes);
  }
  exchange();
  for (int k = 0; k < N; ++k) srcs_[k] = k == node_ ? w.buf : small_buf_.data() + size_t(k) * kSmallBytes;
  char* sum = small_buf_.data() + size_t(N) * kSmallBytes;
  reduce_many(w.dtype, w.op, sum, srcs_.data(), N, w.count);
  copy_scaled(w.dtype, w.buf, sum, w.count, divisor);
}

void Engine::pipelined_allreduce(const Work& w, double divisor) {
  // One rank per node: the data never leaves the user's buffer. Chunks are pipelined two
  // deep: chunk k+1's shards travel (the kernel moves them into the socket buffers on both
  // sides) while chunk k is reduced, and chunk k's reduced shard goes back out behind them.
  // Each node scales its own shard before sending it, so AVG costs 1/N of a pass.
  int N = num_nodes();
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, cfg_.chunk_bytes / esz);
  size_t K = (w.count + chunk - 1) / chunk;
  FrameHeader base = frame_base(w);
  auto span = [&](size_t k) { return std::min(chunk, w.count - k * chunk); };
  size_t depth = size_t(pipeline_depth_);
  for (size_t k = 0; k < std::min(K, depth); ++k)
    post_scatter(base, w.buf + k * chunk * esz, k * chunk, span(k), int(k & 1));
  for (size_t k = 0; k < K; ++k) {
    size_t off = k * chunk, n = span(k);
    char* red = w.buf + off * esz;
    exchange(int(k & 1));
    reduce_shard(w, red, n, int(k & 1));
    if (divisor != 1.0) {
      size_t my_lo = shard_lo(n, node_, N), my_n = shard_lo(n, node_ + 1, N) - my_lo;
      copy_scaled(w.dtype, red + my_lo * esz, red + my_lo * esz, my_n, divisor);
    }
    post_gather(base, red, off, n);
    if (depth == 1) exchange();  // chunk by chunk: scatter, reduce, gather, then the next
    if (k + depth < K)
      post_scatter(base, w.buf + (k + depth) * chunk * esz, (k + depth) * chunk, span(k + depth), int((k + depth) & 1));
  }
  exchange();
}

// ---------------------------------------------------------------- collectives

void Engine::run_allreduce(const Work& w) {
  int L = local_size(), N = num_nodes();
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, cfg_.chunk_bytes / esz);
  double divisor = w.op == ReduceOp::AVG ? double(world_size()) : 1.0;
  if (N == 1 && L > 1 && w.count * esz <= kSmallBytes) {
    small_set_ ^= 1;
    std::memcpy(small_slot(small_set_, local_), w.buf, w.count * esz);
    publish_desc(w, small_set_);
    node_barrier();
    check_descs(w, small_set_);
    for (int l = 0; l < L; ++l) srcs_[l] = small_slot(small_set_, l);
    reduce_many(w.dtype, w.op, w.buf, srcs_.data(), L, w.count);
    copy_scaled(w.dtype, w.buf, w.buf, w.count, divisor);
    return;
  }
  if (L == 1) {
    if (w.count * esz <= kSmallBytes) small_tcp_allreduce(w, divisor);
    else pipelined_allreduce(w, divisor);
    return;
  }
  for (size_t off = 0; off < w.count; off += chunk) {
    size_t n = std::min(chunk, w.count - off);
    char* user = w.buf + off * esz;
    char* red = user;
    if (L > 1) {
      // Only the parts other ranks reduce go through shared memory; this rank reads its own
      // part straight from its buffer (saves 1/L of the copy-in).
      size_t p0 = n * size_t(local_) / size_t(L), p1 = n * size_t(local_ + 1) / size_t(L);
      std::memcpy(slot(local_), user, p0 * esz);
      std::memcpy(slot(local_) + p1 * esz, user + p1 * esz, (n - p1) * esz);
      if (off == 0) publish_desc(w, 2);
      node_barrier();
      if (off == 0) check_descs(w, 2);
      for (int l = 0; l < L; ++l) srcs_[l] = slot(l) + p0 * esz;
      srcs_[local_] = user + p0 * esz;
      red = red_area();
      reduce_many(w.dtype, w.op, red + p0 * esz, srcs_.data(), L, p1 - p0);
      node_barrier();
    }
    if (N > 1) {
      if (is_leader()) inter_node_allreduce(w, red, off, n);
      if (L > 1) node_barrier();
    }
    copy_scaled(w.dtype, user, red, n, divisor);
  }
}

void Engine::run_broadcast(const Work& w) {
  int L = local_size(), N = num_nodes();
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, cfg_.chunk_bytes / esz);
  int root_node = cfg_.node_of_rank[w.root];
  auto& rn = ranks_of_node_[root_node];
  int root_local = int(std::find(rn.begin(), rn.end(), w.root) - rn.begin());
  bool i_am_root = cfg_.rank == w.root;
  for (size_t off = 0; off < w.count; off += chunk) {
    size_t n = std::min(chunk, w.count - off);
    char* user = w.buf + off * esz;
    char* src = user;  // where this node's copy of the chunk lives
    if (L > 1) {
      src = node_ == root_node ? slot(root_local) : red_area();
      if (i_am_root) std::memcpy(src, user, n * esz);
      if (off == 0) publish_desc(w, 2);
      node_barrier();
      if (off == 0) check_descs(w, 2);
    }
    if (N > 1 && is_leader()) {
      FrameHeader h = frame_base(w);
      h.offset = off;
      h.nbytes = n * esz;
      if (node_ == root_node) {
        for (int k = 0; k < N; ++k)
          if (k != node_) post_send(peers_[k], h, src);
      } else {
        h.src_rank = uint32_t(ranks_of_node_[root_node][0]);
        post_recv(peers_[root_node], h, src);
      }
      // One rank per node: the data stays in the user's buffer, so all chunks go out at once.
      if (L > 1 || off + n >= w.count) exchange();
    }
    if (L > 1) {
      if (N > 1) node_barrier();
      if (!i_am_root) std::memcpy(user, src, n * esz);
      node_barrier();  // the root may overwrite its slot only when everyone has read it
    }
  }
}

// ---------------------------------------------------------------- shutdown

void Engine::shutdown() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_ && !progress_.joinable() && !acceptor_.joinable()) return;
    // Let queued collectives finish (or fail) before stopping.
    double deadline = now_s() + std::min(cfg_.timeout_s, 30.0);
    while (!queue_.empty() && !failed_from_ && now_s() < deadline)
      done_cv_.wait_for(lk, std::chrono::milliseconds(50));
    stopping_ = true;
    work_cv_.notify_all();
    done_cv_.notify_all();
  }
  if (progress_.joinable()) progress_.join();
  if (acceptor_.joinable()) acceptor_.join();
  double deadline = now_s() + 1.0;
  for (auto& p : peers_) {
    if (p.fd < 0) continue;
    if (!p.send_active) {
      FrameHeader h{};
      h.magic = kFrameMagic;
      h.type = uint8_t(FrameType::BYE);
      h.src_rank = uint32_t(cfg_.rank);
      write_all(p.fd, &h, sizeof(h), deadline);
    }
    ::close(p.fd);
    p.fd = -1;
  }
  for (int& fd : local_fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  if (leader_fd_ >= 0) {
    char b = 'B';
    write_all(leader_fd_, &b, 1, deadline);
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
  if (shm_) {
    if (is_leader() && !setup_done_.load() && !shm_name_.empty()) shm_unlink(shm_name_.c_str());
    munmap(shm_, shm_size_);
    shm_ = nullptr;
  }
}

}  // namespace sdp
