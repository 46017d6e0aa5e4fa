// gather, scatter and all_to_all between the ranks of one node. Small ones go through the ranks'
// shared-memory slots (one copy in, one copy out, no socket); large ones read straight from the
// peers' memory (process_vm_readv: one copy, every reader at once) where the node allows it, else
// through the slots chunk by chunk. Either way with the same description check and barriers as
// the other collectives. In a group of several nodes, scatter runs here for the root's node (the other
// nodes' ranks submit it too, which keeps every rank's sequence in step, and return at once) and
// all_to_all for each node's blocks, while sdp_jupyter.comm sends the other blocks as messages;
// gather across nodes is all messages (Engine::submit refuses it).
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "sdp/coll_records.h"
#include "sdp/collectives.h"
#include "sdp/common.h"

namespace sdp {

namespace {
// A rank's record in its slot: pid, the address of its nonce, the nonce, its probe verdict (1: it
// read every peer's nonce), then one address per local rank (what the collective lets peers read).
constexpr size_t kRecHead = 4;
}  // namespace

uint64_t Collectives::rec(int l, size_t i) const {
  uint64_t v;
  std::memcpy(&v, shm_.slot(l) + i * 8, 8);
  return v;
}

void Collectives::set_rec(size_t i, uint64_t v) { std::memcpy(shm_.slot(topo_.local) + i * 8, &v, 8); }

const char* Collectives::peer_addr(int l, size_t i) const {
  return reinterpret_cast<const char*>(uintptr_t(rec(l, kRecHead + i)));
}

void Collectives::read_peer(int l, const char* addr, char* dst, size_t bytes) {
  pid_t pid = pid_t(rec(l, 0));
  while (bytes > 0) {
    iovec mine{dst, bytes}, theirs{const_cast<char*>(addr), bytes};
    ssize_t got = process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const char* why = got < 0 ? std::strerror(errno) : "nothing read";  // before desc() allocates
      op_.fail("reading " + std::to_string(bytes) + " bytes from " + topo_.rank_name(topo_.ranks_of_node[topo_.node][l]) +
               "'s memory failed in " + op_.desc() + ": " + why +
               " (SDP_NO_CMA=1 sends large gather, scatter and all_to_all through shared memory instead)");
    }
    addr += got;
    dst += got;
    bytes -= size_t(got);
    peer_read_bytes_.fetch_add(uint64_t(got), std::memory_order_relaxed);
  }
}

// Every local rank reads every other rank's nonce through its pid and address: a wrong PID
// namespace, Yama's ptrace_scope or a seccomp filter fails it. The verdicts are then put to a
// vote, so every rank of the node takes the same path (SDP_NO_CMA=1 on any rank votes no).
bool Collectives::probe_single_copy() {
  int L = topo_.local_size(), local = topo_.local;
  bool ok = !no_cma_;
  for (int l = 0; ok && l < L; ++l) {
    if (l == local) continue;
    uint64_t seen = 0;
    iovec mine{&seen, 8}, theirs{reinterpret_cast<void*>(uintptr_t(rec(l, 1))), 8};
    ok = process_vm_readv(pid_t(rec(l, 0)), &mine, 1, &theirs, 1, 0) == 8 && seen == rec(l, 2);
  }
  set_rec(3, ok ? 1 : 2);
  shm_.barrier();
  bool all = true;
  for (int l = 0; l < L; ++l) all = all && rec(l, 3) == 1;
  return all;
}

bool Collectives::single_copy(const Work& w, const std::vector<const char*>& addrs) {
  int L = topo_.local_size();
  // chunk_bytes_ and L are the same on every local rank, so this refusal is unanimous
  if (single_copy_ == 0 || (kRecHead + size_t(L)) * 8 > chunk_bytes_) return false;
  if (nonce_ == 0) {
    std::random_device rd;
    nonce_ = (uint64_t(rd()) << 32 | rd()) | 1;
  }
  set_rec(0, uint64_t(getpid()));
  set_rec(1, uint64_t(uintptr_t(&nonce_)));
  set_rec(2, nonce_);
  for (int l = 0; l < L; ++l) set_rec(kRecHead + size_t(l), size_t(l) < addrs.size() ? uint64_t(uintptr_t(addrs[l])) : 0);
  shm_.publish_desc(w, 2);
  shm_.barrier();
  shm_.check_descs(2);
  if (single_copy_ < 0) {
    single_copy_ = probe_single_copy() ? 1 : 0;
    if (single_copy_ == 0) shm_.barrier();  // every verdict is read before the slots are refilled
  }
  return single_copy_ == 1;
}

// gather (to the root) and scatter (from it): each non-root rank's buffer goes through that
// rank's slot, chunk by chunk, straight from or to the root's per-rank buffers; the root's own
// block is one copy. Up to kSmallBytes, the small slots of the alternating set carry it with one
// barrier (as the small all_reduce does: the set is refilled two collectives later, after a
// barrier the reader has passed).
void Collectives::rooted(const Work& w, bool to_root) {
  int L = topo_.local_size(), local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  bool root = topo_.rank == w.root;
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  if (topo_.node_of_rank[size_t(w.root)] != topo_.node) return;  // the root's blocks for this node go as messages
  auto own_block = [&] {  // the root's own block: one copy, touching only the root's buffers
    if (!root || w.blocks[w.root] == w.buf) return;
    if (to_root) std::memcpy(w.blocks[w.root], w.buf, n * esz);
    else std::memcpy(w.buf, w.blocks[w.root], n * esz);
  };
  // one round: `m` elements from element `off`, through slot(l) (or the small slots of `set`)
  auto round = [&](size_t off, size_t m, int set) {
    auto slot = [&](int l) { return set < 0 ? shm_.slot(l) : shm_.small_slot(set, l); };
    if (to_root && !root) std::memcpy(slot(local), w.buf + off * esz, m * esz);
    if (!to_root && root)
      for (int l = 0; l < L; ++l)
        if (l != local) std::memcpy(slot(l), w.blocks[ranks[l]] + off * esz, m * esz);
    if (off == 0) shm_.publish_desc(w, set < 0 ? 2 : set);
    shm_.barrier();
    if (off == 0) shm_.check_descs(set < 0 ? 2 : set);
    if (to_root && root)
      for (int l = 0; l < L; ++l)
        if (l != local) std::memcpy(w.blocks[ranks[l]] + off * esz, slot(l), m * esz);
    if (!to_root && !root) std::memcpy(w.buf + off * esz, slot(local), m * esz);
  };
  if (L == 1) return own_block();  // the root alone on its node: the other blocks are messages
  if (n * esz <= kSmallBytes) {
    own_block();
    small_set_ ^= 1;
    round(0, n, small_set_);
    return;
  }
  std::vector<const char*> addrs;  // what peers read: the root's blocks (scatter), each buffer (gather)
  if (!to_root && root)
    for (int l = 0; l < L; ++l) addrs.push_back(w.blocks[ranks[l]]);
  if (to_root && !root) addrs.push_back(w.buf);
  if (single_copy(w, addrs)) {
    // after the barrier, so a scatter's readers read while the root copies its own block (they
    // waited for that copy when it came first: 2 ranks, 64 MiB, 10.1 ms where gloo took 18.1)
    own_block();
    int root_local = int(std::find(ranks.begin(), ranks.end(), w.root) - ranks.begin());
    if (to_root && root)
      for (int l = 0; l < L; ++l)
        if (l != local) read_peer(l, peer_addr(l, 0), w.blocks[ranks[l]], n * esz);
    if (!to_root && !root)
      read_peer(root_local, peer_addr(root_local, size_t(local)), w.buf, n * esz);
    shm_.barrier();  // nobody returns (and frees what a peer reads) before every read is done
    return;
  }
  own_block();
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  for (size_t off = 0; off < n; off += chunk) {
    round(off, std::min(chunk, n - off), -1);
    shm_.barrier();  // a slot is refilled only when its reader is done with it
  }
}

void Collectives::gather(const Work& w) { rooted(w, true); }

void Collectives::one_rank(const Work& w) {
  size_t bytes = w.count * dtype_size(w.dtype);
  switch (coll_record(w.coll).alone) {  // what the record says a group of one does
    case Alone::KEEP: break;
    case Alone::BUF_TO_BLOCK: if (w.blocks[0] != w.buf) std::memcpy(w.blocks[0], w.buf, bytes); break;
    case Alone::BLOCK_TO_BUF: if (w.blocks[0] != w.buf) std::memcpy(w.buf, w.blocks[0], bytes); break;
    case Alone::SRC_TO_BUF: if (w.src != w.buf) std::memcpy(w.buf, w.src, bytes); break;
  }
}
void Collectives::scatter(const Work& w) { rooted(w, false); }

void Collectives::all_to_all(const Work& w) {
  // The blocks between the ranks of this node (all of them when the group is one node; across
  // nodes sdp_jupyter.comm sends the other blocks as messages meanwhile). Each round moves a
  // piece of every block: rank l's slot holds L pieces, piece j for the rank at local index j;
  // after the barrier each rank takes its piece from every other slot.
  int L = topo_.local_size(), local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  size_t piece = std::max<size_t>(1, chunk_bytes_ / esz / size_t(L));
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  auto block = [&](int l) { return size_t(ranks[l]) * n * esz; };  // byte offset of local rank l's block
  std::memcpy(w.buf + block(local), w.src + block(local), n * esz);
  if (L == 1) return;  // alone on its node: no shared memory, nothing else to move here
  if (n * esz * size_t(L) > kSmallBytes && single_copy(w, {w.src})) {
    for (int l = 0; l < L; ++l)  // my block of each peer's input, straight into my output
      if (l != local) read_peer(l, peer_addr(l, 0) + block(local), w.buf + block(l), n * esz);
    shm_.barrier();
    return;
  }
  for (size_t off = 0; off < n; off += piece) {
    size_t m = std::min(piece, n - off);
    for (int j = 0; j < L; ++j)
      if (j != local) std::memcpy(shm_.slot(local) + size_t(j) * piece * esz, w.src + block(j) + off * esz, m * esz);
    if (off == 0) shm_.publish_desc(w, 2);
    shm_.barrier();
    if (off == 0) shm_.check_descs(2);
    for (int l = 0; l < L; ++l)
      if (l != local) std::memcpy(w.buf + block(l) + off * esz, shm_.slot(l) + size_t(local) * piece * esz, m * esz);
    shm_.barrier();
  }
}

}  // namespace sdp
