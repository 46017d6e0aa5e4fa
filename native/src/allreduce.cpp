// all_reduce. Within a node: every rank copies its chunk into its slot, then reduces an equal
// part of the chunk across all slots (small buffers: one barrier, every rank sums everything).
// Across nodes, only leaders talk: the node-reduced chunk is split into one shard per node,
// node k sums shard k from every node and sends the sum back.
#include <algorithm>
#include <cstring>

#include "sdp/collectives.h"
#include "sdp/common.h"
#include "sdp/reduce.h"

namespace sdp {

void Collectives::start() {
  int N = topo_.num_nodes(), L = topo_.local_size();
  if (topo_.is_leader()) {
    if (N > 1) recv_buf_.assign(2 * size_t(N) * recv_slot_bytes(), 0);  // two sets, touched once now
    if (N > 1 && one_rank_per_node()) small_buf_.assign(size_t(N + 1) * kSmallBytes, 0);
  }
  srcs_.resize(size_t(std::max(L, N) + 1));
  no_cma_ = env_bool("SDP_NO_CMA", false);  // read at set-up: a bad value fails init, not a collective
}

// A shard of a chunk (plus slack for uneven splits), rounded to 64 bytes so every slot starts
// aligned for any element type (3 nodes and 4 KiB chunks once put slot 1 at an odd address:
// UBSan's misaligned-load report, found by the sanitizer run in tests/test_native_builds.py).
size_t Collectives::recv_slot_bytes() const {
  size_t b = chunk_bytes_ / size_t(topo_.num_nodes()) + 64;
  return (b + 63) / 64 * 64;
}
// Where the shard from node k lands in receive set `set` (two sets, one per chunk in flight).
char* Collectives::recv_slot(int set, int k) {
  return recv_buf_.data() + (size_t(set) * size_t(topo_.num_nodes()) + size_t(k)) * recv_slot_bytes();
}

// The frame that carries shard s of the chunk starting at element `off`.
static FrameHeader shard_frame(const FrameHeader& base, size_t off, Shard s, size_t esz) {
  FrameHeader h = base;
  h.offset = off + s.lo;
  h.nbytes = s.count * esz;
  return h;
}

void Collectives::post_scatter(const FrameHeader& base, char* red, size_t off, size_t n, int set) {
  // Node k receives shard k of every node's chunk, into receive set `set` (two sets, so the
  // next chunk can arrive while this one is being reduced).
  int N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(DType(base.dtype));
  Shard mine = shard(n, me, N);
  for (int k = 0; k < N; ++k) {
    if (k == me) continue;
    Shard theirs = shard(n, k, N);
    links_.post_send(k, shard_frame(base, off, theirs, esz), red + theirs.lo * esz);
    links_.post_recv(k, shard_frame(base, off, mine, esz), recv_slot(set, k));
    links_.mark_scatter(k, set);
  }
}

void Collectives::reduce_shard(const Work& w, char* red, size_t n, int set) {
  int N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(w.dtype);
  Shard mine = shard(n, me, N);
  int ns = 0;
  srcs_[ns++] = red + mine.lo * esz;
  for (int k = 0; k < N; ++k)
    if (k != me) srcs_[ns++] = recv_slot(set, k);
  reduce_many(w.dtype, w.op, red + mine.lo * esz, srcs_.data(), ns, mine.count);
}

void Collectives::post_gather(const FrameHeader& base, char* red, size_t off, size_t n) {
  // Every node gets every reduced shard, straight into place.
  int N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(DType(base.dtype));
  Shard mine = shard(n, me, N);
  for (int k = 0; k < N; ++k) {
    if (k == me) continue;
    Shard theirs = shard(n, k, N);
    links_.post_send(k, shard_frame(base, off, mine, esz), red + mine.lo * esz);
    links_.post_recv(k, shard_frame(base, off, theirs, esz), red + theirs.lo * esz);
  }
}

void Collectives::inter_node_allreduce(const Work& w, char* red, size_t off, size_t n) {
  // One chunk that lives in the node's shared memory (several ranks per node): scatter,
  // reduce, gather, in lockstep with the node's barriers.
  FrameHeader base = links_.frame_base(w);
  post_scatter(base, red, off, n, 0);
  links_.exchange(0);
  reduce_shard(w, red, n, 0);
  post_gather(base, red, off, n);
  links_.exchange();
}

void Collectives::small_tcp_allreduce(const Work& w, double divisor) {
  // Small all-reduce, one rank per node: every node sends its whole buffer to every other and
  // sums all of them itself. One exchange instead of scatter + gather halves the round trips
  // (latency is all that matters up to kSmallBytes). Every node sums in node order, so all of
  // them get the same bits.
  int N = topo_.num_nodes(), me = topo_.node;
  size_t bytes = w.count * dtype_size(w.dtype);
  FrameHeader h = links_.frame_base(w);
  h.offset = 0;
  h.nbytes = bytes;
  for (int k = 0; k < N; ++k) {
    if (k == me) continue;
    links_.post_send(k, h, w.buf);
    links_.post_recv(k, h, small_buf_.data() + size_t(k) * kSmallBytes);
  }
  links_.exchange();
  for (int k = 0; k < N; ++k) srcs_[k] = k == me ? w.buf : small_buf_.data() + size_t(k) * kSmallBytes;
  char* sum = small_buf_.data() + size_t(N) * kSmallBytes;
  reduce_many(w.dtype, w.op, sum, srcs_.data(), N, w.count);
  copy_scaled(w.dtype, w.buf, sum, w.count, divisor);
}

void Collectives::pipelined_allreduce(const Work& w, double divisor) {
  // One rank per node: the data never leaves the user's buffer. Chunks are pipelined two
  // deep: chunk k+1's shards travel (the kernel moves them into the socket buffers on both
  // sides) while chunk k is reduced, and chunk k's reduced shard goes back out behind them.
  // Each node scales its own shard before sending it, so AVG costs 1/N of a pass.
  int N = topo_.num_nodes(), me = topo_.node;
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  size_t K = (w.count + chunk - 1) / chunk;
  FrameHeader base = links_.frame_base(w);
  auto span = [&](size_t k) { return std::min(chunk, w.count - k * chunk); };
  size_t depth = size_t(pipeline_depth_);
  for (size_t k = 0; k < std::min(K, depth); ++k)
    post_scatter(base, w.buf + k * chunk * esz, k * chunk, span(k), int(k & 1));
  for (size_t k = 0; k < K; ++k) {
    size_t off = k * chunk, n = span(k);
    char* red = w.buf + off * esz;
    links_.exchange(int(k & 1));
    reduce_shard(w, red, n, int(k & 1));
    if (divisor != 1.0) {
      Shard mine = shard(n, me, N);
      copy_scaled(w.dtype, red + mine.lo * esz, red + mine.lo * esz, mine.count, divisor);
    }
    post_gather(base, red, off, n);
    if (depth == 1) links_.exchange();  // chunk by chunk: scatter, reduce, gather, then the next
    if (k + depth < K)
      post_scatter(base, w.buf + (k + depth) * chunk * esz, (k + depth) * chunk, span(k + depth), int((k + depth) & 1));
  }
  links_.exchange();
}

void Collectives::all_reduce(const Work& w) {
  int L = topo_.local_size(), N = topo_.num_nodes(), local = topo_.local;
  size_t esz = dtype_size(w.dtype);
  size_t chunk = std::max<size_t>(1, chunk_bytes_ / esz);
  double divisor = w.op == ReduceOp::AVG ? double(topo_.world_size()) : 1.0;
  if (N == 1 && L > 1 && w.count * esz <= kSmallBytes) {
    small_set_ ^= 1;
    std::memcpy(shm_.small_slot(small_set_, local), w.buf, w.count * esz);
    shm_.publish_desc(w, small_set_);
    shm_.barrier();
    shm_.check_descs(small_set_);
    for (int l = 0; l < L; ++l) srcs_[l] = shm_.small_slot(small_set_, l);
    reduce_many(w.dtype, w.op, w.buf, srcs_.data(), L, w.count);
    copy_scaled(w.dtype, w.buf, w.buf, w.count, divisor);
    return;
  }
  if (one_rank_per_node()) {
    if (w.count * esz <= kSmallBytes) small_tcp_allreduce(w, divisor);
    else pipelined_allreduce(w, divisor);
    return;
  }
  // Several ranks on some node (this one may have only one: then it reduces in its buffer).
  for (size_t off = 0; off < w.count; off += chunk) {
    size_t n = std::min(chunk, w.count - off);
    char* user = w.buf + off * esz;
    char* red = user;
    if (L > 1) {
      // Only the parts other ranks reduce go through shared memory; this rank reads its own
      // part straight from its buffer (saves 1/L of the copy-in).
      size_t p0 = n * size_t(local) / size_t(L), p1 = n * size_t(local + 1) / size_t(L);
      std::memcpy(shm_.slot(local), user, p0 * esz);
      std::memcpy(shm_.slot(local) + p1 * esz, user + p1 * esz, (n - p1) * esz);
      if (off == 0) shm_.publish_desc(w, 2);
      shm_.barrier();
      if (off == 0) shm_.check_descs(2);
      for (int l = 0; l < L; ++l) srcs_[l] = shm_.slot(l) + p0 * esz;
      srcs_[local] = user + p0 * esz;
      red = shm_.red_area();
      reduce_many(w.dtype, w.op, red + p0 * esz, srcs_.data(), L, p1 - p0);
      shm_.barrier();
    }
    if (N > 1) {
      if (topo_.is_leader()) inter_node_allreduce(w, red, off, n);
      if (L > 1) shm_.barrier();
    }
    if (red != user || divisor != 1.0) copy_scaled(w.dtype, user, red, n, divisor);
  }
}

}  // namespace sdp
