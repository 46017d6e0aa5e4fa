// broadcast. Within a node the root's chunk goes through its slot (or, on other nodes, the
// reduce area the leader receives into); across nodes the root's leader sends every chunk to
// every other leader.
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"

namespace sdp {

void Collectives::broadcast(const Work& w) {
  int L = topo_.local_size(), N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  int root_node = topo_.node_of_rank[w.root];
  auto& rn = topo_.ranks_of_node[root_node];
  int root_local = int(std::find(rn.begin(), rn.end(), w.root) - rn.begin());
  bool i_am_root = topo_.rank == w.root;
  for (size_t off = 0; off < w.count; off += chunk) {
    size_t n = std::min(chunk, w.count - off);
    char* user = w.buf + off * esz;
    char* src = user;  // where this node's copy of the chunk lives
    if (L > 1) {
      src = me == root_node ? shm_.slot(root_local) : shm_.red_area();
      if (i_am_root) std::memcpy(src, user, n * esz);
      if (off == 0) shm_.publish_desc(w, 2);
      shm_.barrier();
      if (off == 0) shm_.check_descs(2);
    }
    if (N > 1 && topo_.is_leader()) {
      FrameHeader h = links_.frame_base(w);
      h.offset = off;
      h.nbytes = n * esz;
      if (me == root_node) {
        for (int k = 0; k < N; ++k)
          if (k != me) links_.post_send(k, h, src);
      } else {
        h.src_rank = uint32_t(topo_.leader_of(root_node));
        links_.post_recv(root_node, h, src);
      }
      // One rank per node: the data stays in the user's buffer, so all chunks go out at once.
      if (L > 1 || off + n >= w.count) links_.exchange();
    }
    if (L > 1) {
      if (N > 1) shm_.barrier();
      if (!i_am_root) std::memcpy(user, src, n * esz);
      shm_.barrier();  // the root may overwrite its slot only when everyone has read it
    }
  }
}

}  // namespace sdp
