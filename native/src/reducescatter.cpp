// reduce_scatter, in place on world_size blocks: rank r's result lands in its block r. On one
// node, rounds of one piece of every block: each rank copies the pieces of the others' blocks
// into its slot, then reduces its own block's piece from every slot (all ranks reduce at once,
// each its own block). One rank per node: each node sends block r to rank r's node and reduces
// the blocks it receives for itself (each node receives (N-1)/N of one buffer, not all of it).
// Several ranks on several nodes: a full all_reduce of the blocks, and each rank keeps its own.
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"
#include "sdp/reduce.h"

namespace sdp {

void Collectives::reduce_scatter(const Work& w) {
  int N = topo_.num_nodes();
  double divisor = w.op == ReduceOp::AVG ? double(topo_.world_size()) : 1.0;
  if (N == 1) return node_reduce_scatter(w, divisor);
  if (one_rank_per_node()) return tcp_reduce_scatter(w, divisor);
  Work whole = w;
  whole.count = w.count * size_t(topo_.world_size());
  all_reduce(whole);
}

void Collectives::node_reduce_scatter(const Work& w, double divisor) {
  int L = topo_.local_size(), local = topo_.local;
  size_t esz = dtype_size(w.dtype), n = w.count;
  size_t piece = std::max<size_t>(1, chunk_bytes_ / esz / size_t(L));  // L pieces fill one slot
  auto block = [&](int r) { return w.buf + size_t(r) * n * esz; };  // one node: local index == rank
  for (size_t off = 0; off < n; off += piece) {
    size_t m = std::min(piece, n - off);
    for (int b = 0; b < L; ++b)
      if (b != local) std::memcpy(shm_.slot(local) + size_t(b) * piece * esz, block(b) + off * esz, m * esz);
    if (off == 0) shm_.publish_desc(w, 2);
    shm_.barrier();
    if (off == 0) shm_.check_descs(2);
    char* dst = block(local) + off * esz;
    int ns = 0;
    srcs_[ns++] = dst;
    for (int l = 0; l < L; ++l)
      if (l != local) srcs_[ns++] = shm_.slot(l) + size_t(local) * piece * esz;
    reduce_many(w.dtype, w.op, dst, srcs_.data(), ns, m);
    if (divisor != 1.0) copy_scaled(w.dtype, dst, dst, m, divisor);
    shm_.barrier();  // slots are refilled only when every rank has reduced from them
  }
}

void Collectives::tcp_reduce_scatter(const Work& w, double divisor) {
  int N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(w.dtype), n = w.count, bytes = n * esz;
  if (n == 0) return;
  if (rs_buf_.size() < size_t(N) * bytes) rs_buf_.resize(size_t(N) * bytes);
  FrameHeader base = links_.frame_base(w);
  for (int k = 0; k < N; ++k) {
    if (k == me) continue;
    int rk = topo_.leader_of(k);
    FrameHeader h = base;
    h.offset = size_t(rk) * n;
    h.nbytes = bytes;
    links_.post_send(k, h, w.buf + size_t(rk) * bytes);
    FrameHeader e = base;
    e.offset = size_t(topo_.rank) * n;
    e.nbytes = bytes;
    links_.post_recv(k, e, rs_buf_.data() + size_t(k) * bytes);
  }
  links_.exchange();
  char* dst = w.buf + size_t(topo_.rank) * bytes;
  int ns = 0;
  srcs_[ns++] = dst;
  for (int k = 0; k < N; ++k)
    if (k != me) srcs_[ns++] = rs_buf_.data() + size_t(k) * bytes;
  reduce_many(w.dtype, w.op, dst, srcs_.data(), ns, n);
  if (divisor != 1.0) copy_scaled(w.dtype, dst, dst, n, divisor);
}

}  // namespace sdp
