// gather, scatter and all_to_all within one node: the data goes through the ranks' shared-memory
// slots, chunk by chunk (one copy in, one copy out, no socket), with the same description check
// and barriers as the other collectives. Across nodes the torch backend sends messages instead
// (Engine::submit refuses these there).
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"

namespace sdp {

// gather (to the root) and scatter (from it): each non-root rank's block goes through that rank's
// slot, chunk by chunk; the root's own block goes straight from `src` to `buf`.
void Collectives::rooted(const Work& w, bool to_root) {
  int L = topo_.local_size(), local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  bool root = topo_.rank == w.root;
  const auto& ranks = topo_.ranks_of_node[topo_.node];
  size_t own = size_t(w.root) * n * esz;
  const char* own_src = to_root ? w.src : w.src + own;
  char* own_dst = to_root ? w.buf + own : w.buf;
  if (root && own_src != own_dst) std::memcpy(own_dst, own_src, n * esz);
  for (size_t off = 0; off < n; off += chunk) {
    size_t m = std::min(chunk, n - off);
    auto at = [&](int l) { return (size_t(ranks[l]) * n + off) * esz; };  // chunk of local rank l's block
    if (to_root && !root) std::memcpy(shm_.slot(local), w.src + off * esz, m * esz);
    if (!to_root && root)
      for (int l = 0; l < L; ++l)
        if (l != local) std::memcpy(shm_.slot(l), w.src + at(l), m * esz);
    if (off == 0) shm_.publish_desc(w, 2);
    shm_.barrier();
    if (off == 0) shm_.check_descs(2);
    if (to_root && root)
      for (int l = 0; l < L; ++l)
        if (l != local) std::memcpy(w.buf + at(l), shm_.slot(l), m * esz);
    if (!to_root && !root) std::memcpy(w.buf + off * esz, shm_.slot(local), m * esz);
    shm_.barrier();  // a slot is refilled only when its reader is done with it
  }
}

void Collectives::gather(const Work& w) { rooted(w, true); }
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
