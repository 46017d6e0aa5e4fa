// gather, scatter and all_to_all within one node: the data goes through the ranks' shared-memory
// slots, chunk by chunk (one copy in, one copy out, no socket), with the same description check
// and barriers as the other collectives. Across nodes the torch backend sends messages instead
// (Engine::submit refuses these there).
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"

namespace sdp {

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
  if (root && w.blocks[w.root] != w.buf) {
    if (to_root) std::memcpy(w.blocks[w.root], w.buf, n * esz);
    else std::memcpy(w.buf, w.blocks[w.root], n * esz);
  }
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
  if (n * esz <= kSmallBytes) {
    small_set_ ^= 1;
    round(0, n, small_set_);
    return;
  }
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  for (size_t off = 0; off < n; off += chunk) {
    round(off, std::min(chunk, n - off), -1);
    shm_.barrier();  // a slot is refilled only when its reader is done with it
  }
}

void Collectives::gather(const Work& w) { rooted(w, true); }

void Collectives::one_rank(const Work& w) {
  size_t bytes = w.count * dtype_size(w.dtype);
  if (w.coll == Coll::GATHER && w.blocks[0] != w.buf) std::memcpy(w.blocks[0], w.buf, bytes);
  if (w.coll == Coll::SCATTER && w.blocks[0] != w.buf) std::memcpy(w.buf, w.blocks[0], bytes);
  if (w.coll == Coll::ALLTOALL && w.src != w.buf) std::memcpy(w.buf, w.src, bytes);
}
void Collectives::scatter(const Work& w) { rooted(w, false); }

void Collectives::all_to_all(const Work& w) {
  // Each round moves a piece of every block: rank l's slot holds L pieces, piece j for the rank
  // at local index j; after the barrier each rank takes its piece from every other slot.
  int L = topo_.local_size(), local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  size_t piece = std::max<size_t>(1, chunk_bytes_ / esz / size_t(L));
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  auto block = [&](int l) { return size_t(ranks[l]) * n * esz; };  // byte offset of local rank l's block
  std::memcpy(w.buf + block(local), w.src + block(local), n * esz);
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
