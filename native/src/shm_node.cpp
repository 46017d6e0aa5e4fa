#include "sdp/shm_node.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "sdp/hmac.h"
#include "sdp/transport.h"

namespace sdp {

constexpr uint32_t kShmMagic = 0x4d484453;    // "SDHM"
constexpr uint32_t kOfferMagic = 0x4f504453;  // "SDPO"

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
size_t header_bytes() { return round_up(sizeof(ShmHeader), 4096); }

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

}  // namespace

void ShmNode::create() {
  int L = topo_.local_size();
  remove_stale_segments();
  uint8_t rnd[8];
  random_bytes(rnd, sizeof(rnd));
  char name[64];
  std::snprintf(name, sizeof(name), "/sdp-%d-%02x%02x%02x%02x%02x%02x", getpid(), rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
  name_ = name;
  size_ = header_bytes() + size_t(L + 1) * chunk_bytes_ + 2 * size_t(L) * kSmallBytes;
  int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error("cannot create shared memory " + name_ + ": " + std::strerror(errno));
  // fallocate, not ftruncate: it reserves the pages now, so a /dev/shm too small (Docker's 64 MiB
  // default) is this error and not a SIGBUS at the first touch of a page that was never there.
  if (int rc = posix_fallocate(fd, 0, off_t(size_)); rc != 0) {
    ::close(fd);
    shm_unlink(name_.c_str());
    throw Error("cannot size shared memory in /dev/shm (" + std::to_string(size_) + " bytes): " + std::strerror(rc) +
                " (/dev/shm is too small for this node's ranks: docker run --shm-size=8g, or lower SDP_CHUNK_BYTES)");
  }
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name_.c_str());
    throw Error(std::string("cannot map shared memory: ") + std::strerror(errno));
  }
  std::memset(p, 0, size_);  // touch every page once, now, not during the first collective
  hdr_ = new (p) ShmHeader();
  hdr_->magic = kShmMagic;
  hdr_->local_size = uint32_t(L);
  hdr_->chunk_bytes = chunk_bytes_;
  random_bytes(hdr_->token, sizeof(hdr_->token));
  data_ = static_cast<char*>(p) + header_bytes();
}

ShmOffer ShmNode::offer() const {
  ShmOffer off{};
  off.magic = kOfferMagic;
  std::snprintf(off.name, sizeof(off.name), "%s", name_.c_str());
  std::memcpy(off.token, hdr_->token, sizeof(off.token));
  off.size = size_;
  return off;
}

void ShmNode::map_offered(int fd, double deadline) {
  ShmOffer off{};
  if (!read_all(fd, &off, sizeof(off), deadline) || off.magic != kOfferMagic)
    throw Error("the node leader " + topo_.rank_name(topo_.leader_of(topo_.node)) +
                " did not offer its shared memory before the deadline");
  off.name[sizeof(off.name) - 1] = 0;
  if (std::strncmp(off.name, "/sdp-", 5) != 0 || std::strchr(off.name + 1, '/'))
    throw Error("protocol error: the node leader offered a bad shared-memory name");
  int sfd = shm_open(off.name, O_RDWR | O_NOFOLLOW, 0);
  if (sfd < 0) throw Error(std::string("cannot open the node's shared memory ") + off.name + ": " + std::strerror(errno));
  struct stat st{};
  if (fstat(sfd, &st) != 0 || st.st_uid != ::geteuid() || (st.st_mode & 0777) != 0600 || uint64_t(st.st_size) != off.size ||
      off.size < header_bytes()) {
    ::close(sfd);
    throw Error(std::string("refusing the node's shared memory ") + off.name +
                ": not a 0600 segment of this user of the offered size (tampered with?)");
  }
  size_ = size_t(off.size);
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, sfd, 0);
  ::close(sfd);
  if (p == MAP_FAILED) throw Error(std::string("cannot map the node's shared memory: ") + std::strerror(errno));
  hdr_ = static_cast<ShmHeader*>(p);
  if (hdr_->magic != kShmMagic || std::memcmp(hdr_->token, off.token, sizeof(off.token)) != 0)
    throw Error("refusing the node's shared memory: it does not hold the token its leader offered");
  if (int(hdr_->local_size) != topo_.local_size() || hdr_->chunk_bytes != chunk_bytes_)
    throw Error("the node's shared memory was made for another layout (SDP_CHUNK_BYTES differs between ranks?)");
  data_ = static_cast<char*>(p) + header_bytes();
}

void ShmNode::unlink() {
  if (!name_.empty()) shm_unlink(name_.c_str());
  name_.clear();
}

void ShmNode::unmap() {
  if (!hdr_) return;
  munmap(hdr_, size_);
  hdr_ = nullptr;
  data_ = nullptr;
}

void ShmNode::publish_desc(const Work& w, int set) {
  CollDesc& d = hdr_->desc[set][topo_.local];
  d.seq = op_.seq;
  d.count = w.count;
  d.root = uint32_t(w.root);
  d.coll = uint8_t(w.coll);
  d.dtype = uint8_t(w.dtype);
  d.op = uint8_t(w.op);
  d.valid = 1;
}

void ShmNode::check_descs(int set) {
  // Every local rank runs the same comparison against the same data, so all of them fail together.
  const CollDesc& a = hdr_->desc[set][0];
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  for (int l = 1; l < topo_.local_size(); ++l) {
    const CollDesc& b = hdr_->desc[set][l];
    std::string field, va, vb;
    if (first_difference(Described{a.seq, a.count, a.root, a.coll, a.dtype, a.op},
                         Described{b.seq, b.count, b.root, b.coll, b.dtype, b.op}, &field, &va, &vb))
      op_.fail("collective mismatch at " + op_.desc() + ": " + field + " differs: rank " + std::to_string(ranks[0]) + " has " +
               va + ", rank " + std::to_string(ranks[l]) + " has " + vb + "; nothing was reduced");
  }
}

void ShmNode::barrier(const std::function<bool()>* while_waiting) {
  int L = topo_.local_size(), local = topo_.local;
  uint64_t mine = ++barrier_count_;
  uint64_t target = mine * uint64_t(L);
  hdr_->rank_arrivals[local].store(mine, std::memory_order_release);
  uint64_t v = hdr_->arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (v == target) {
    hdr_->wake.fetch_add(1);
    // The wake-up is a system call: skip it when every peer is still spinning.
    if (hdr_->sleepers.load() > 0) futex_wake_all(&hdr_->wake);
    return;
  }
  // Health is asked with this barrier's own test: a rank can be preempted between seeing the
  // barrier incomplete and probing its peers, long enough (on an oversubscribed host) for the
  // last rank to arrive, finish the collective and exit; its goodbye must not fail a barrier that
  // every rank reached (found by benchmarks/cluster.py with 16 ranks on 2 cores).
  const std::function<bool()> reached = [&] { return hdr_->arrivals.load(std::memory_order_acquire) >= target; };
  if (while_waiting) {
    for (;;) {
      if (reached()) return;
      if (!(*while_waiting)()) break;  // waited up to a fraction of a millisecond; false: nothing left
      op_.check_health(&reached);
      if (now_s() > op_.deadline) break;  // the sleeping loop below names the late ranks
    }
  }
  // Wait in three stages: a short pause-spin (the peers are usually microseconds away), then
  // sched_yield for up to ~200 us, then a futex sleep that also checks health and the
  // deadline. Measured on 2 cores with 2 ranks training (docs/benchmarks.md): spinning, then
  // yielding, beat going to sleep early, even though the machine is oversubscribed.
  for (int i = 0; i < spin_; ++i) {
    if (hdr_->arrivals.load(std::memory_order_acquire) >= target) return;
    cpu_relax();
  }
  if (yield_) {
    double until = now_s() + 200e-6;
    do {
      for (int i = 0; i < 32; ++i) {
        if (hdr_->arrivals.load(std::memory_order_acquire) >= target) return;
        sched_yield();
      }
    } while (now_s() < until);
  }
  struct Sleeping {  // counted while this rank may be inside futex_wait
    std::atomic<uint32_t>& n;
    explicit Sleeping(std::atomic<uint32_t>& c) : n(c) { n.fetch_add(1); }
    ~Sleeping() { n.fetch_sub(1); }
  } sleeping(hdr_->sleepers);
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  for (;;) {
    uint32_t w = hdr_->wake.load();
    if (reached()) return;
    op_.check_health(&reached);
    if (now_s() > op_.deadline) {
      std::vector<int> late;
      for (int l = 0; l < L; ++l)
        if (hdr_->rank_arrivals[l].load() < mine) late.push_back(ranks[l]);
      // Only the leader is late and it talks to other nodes: it is most likely waiting on the
      // network under the same deadline. Give it a moment to publish the better error (which
      // names the unreachable node) instead of blaming it.
      if (topo_.num_nodes() > 1 && late.size() == 1 && late[0] == ranks[0] && now_s() < op_.deadline + 2.0) {
        futex_wait(&hdr_->wake, w, 2000);
        continue;
      }
      op_.fail("timed out after " + fmt_seconds(op_.timeout_s) + " s in " + op_.desc() + " waiting for rank(s) " +
               Topology::ranks_list(late) + " of " + topo_.node_name(topo_.node) +
               " (stalled or not calling this collective)");
    }
    futex_wait(&hdr_->wake, w, 2000);
  }
}

std::string ShmNode::latch_error(const std::string& msg, bool* remote) {
  uint32_t expected = 0;
  if (hdr_->error_state.compare_exchange_strong(expected, 1)) {
    std::snprintf(hdr_->error_msg, sizeof(hdr_->error_msg), "%s", msg.c_str());
    hdr_->error_remote = *remote ? 1 : 0;
    hdr_->error_rank = uint32_t(topo_.rank);
    hdr_->error_state.store(2, std::memory_order_release);
    hdr_->wake.fetch_add(1);
    futex_wake_all(&hdr_->wake);
    return msg;
  }
  // Another local rank won the error slot: every rank reports the first error, so wait
  // (bounded: the winner may have died mid-write) until its message is published.
  double until = now_s() + 1.0;
  while (hdr_->error_state.load(std::memory_order_acquire) != 2 && now_s() < until) sched_yield();
  std::string m;
  if (published_error(&m, remote)) return m;
  return msg;
}

bool ShmNode::published_error(std::string* msg, bool* remote) const {
  if (!hdr_ || hdr_->error_state.load(std::memory_order_acquire) != 2) return false;
  *msg = hdr_->error_msg;
  *remote = hdr_->error_remote != 0;
  if (msg->empty()) *msg = "rank " + std::to_string(hdr_->error_rank) + " reported an error (its message was lost)";
  return true;
}

}  // namespace sdp
