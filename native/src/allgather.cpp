// all_gather, in place on world_size blocks (block r is rank r's input). Within a node every
// rank puts its block through its slot, chunk by chunk, and copies the others' out. Across
// nodes each leader sends its node's blocks to every other leader straight from its buffer and
// receives theirs straight into place; then it hands them to its local ranks through shared
// memory.
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"

namespace sdp {

void Collectives::all_gather(const Work& w) {
  int L = topo_.local_size(), N = topo_.num_nodes(), me = topo_.node, local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  const auto& mine = topo_.ranks_of_node[me];
  auto block = [&](int r) { return w.buf + size_t(r) * n * esz; };
  if (L > 1) {
    for (size_t off = 0; off < n; off += chunk) {
      size_t m = std::min(chunk, n - off);
      std::memcpy(shm_.slot(local), block(topo_.rank) + off * esz, m * esz);
      if (off == 0) shm_.publish_desc(w, 2);
      shm_.barrier();
      if (off == 0) shm_.check_descs(2);
      for (int l = 0; l < L; ++l)
        if (l != local) std::memcpy(block(mine[l]) + off * esz, shm_.slot(l), m * esz);
      shm_.barrier();  // a slot is refilled only when every rank has read it
    }
  }
  if (N == 1 || n == 0) return;
  if (topo_.is_leader()) {
    FrameHeader base = links_.frame_base(w);
    for (int k = 0; k < N; ++k) {
      if (k == me) continue;
      for (int r : mine) {
        FrameHeader h = base;
        h.offset = size_t(r) * n;
        h.nbytes = n * esz;
        links_.post_send(k, h, block(r));
      }
      for (int r : topo_.ranks_of_node[k]) {  // in the order that node's leader sends them
        FrameHeader e = base;
        e.offset = size_t(r) * n;
        e.nbytes = n * esz;
        links_.post_recv(k, e, block(r));
      }
    }
    links_.exchange();
  }
  if (L == 1) return;
  for (int k = 0; k < N; ++k) {
    if (k == me) continue;
    for (int r : topo_.ranks_of_node[k]) {
      for (size_t off = 0; off < n; off += chunk) {
        size_t m = std::min(chunk, n - off);
        if (topo_.is_leader()) std::memcpy(shm_.red_area(), block(r) + off * esz, m * esz);
        shm_.barrier();
        if (!topo_.is_leader()) std::memcpy(block(r) + off * esz, shm_.red_area(), m * esz);
        shm_.barrier();
      }
    }
  }
}

}  // namespace sdp
