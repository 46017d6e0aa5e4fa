// all_reduce. Within a node: every rank copies its chunk into its slot, then reduces an equal
// part of the chunk across all slots (small buffers: one barrier, every rank sums everything).
// Across nodes, only leaders talk: the node-reduced chunk is split into one shard per node,
// node k sums shard k from every node and sends the sum back. With several ranks per node the
// two overlap: while piece j of the node's sum crosses the links (the leader moves it between
// its own steps), the node copies in and reduces piece j+1 and copies back piece j-1.
#include <algorithm>
#include <cstring>
#include <functional>

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
// UBSan's misaligned-load report, found by the sanitizer run in tests/engine/test_native_builds.py).
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

// ---- pieces of the node's sum across the links, moved in steps (net_advance) so that the
// leader can drive them from inside the node's work: scatter a piece's shards, reduce this node's
// shard once every node's has arrived, gather every node's reduced shard back into place. Two
// pieces may be in flight: the older one's gather and the newer one's scatter share the links.
// Every node posts in the same order (scatter j, gather j, scatter j+1, ...): a piece is started
// only after the piece before it has posted its gather (net_until_gathering).

void Collectives::net_start(const Work& w, char* red, size_t off, size_t n, int set) {
  NetPiece& other = net_[set ^ 1];
  net_older_ = other.active ? set ^ 1 : set;
  net_[set] = {&w, red, off, n, set, 0, true};
  post_scatter(links_.frame_base(w), red, off, n, set);
  links_.step(0);
}

bool Collectives::net_advance(int wait_us) {
  if (!net_[0].active && !net_[1].active) return true;
  links_.step(wait_us);
  for (int set : {net_older_, net_older_ ^ 1}) {
    NetPiece& p = net_[set];
    if (!p.active) continue;
    if (p.phase == 0 && links_.scattered(set)) {
      reduce_shard(*p.w, p.red, p.n, set);
      post_gather(links_.frame_base(*p.w), p.red, p.off, p.n);
      links_.mark_done(set);
      p.phase = 1;
      links_.step(0);
    }
    if (p.phase == 1 && links_.done(set)) p.active = false;
  }
  return !net_[0].active && !net_[1].active;
}

void Collectives::net_until_gathering(int set) {
  while (net_[set].active && net_[set].phase == 0) net_advance(50000);
}

void Collectives::net_finish(int set) {
  while (net_[set].active) net_advance(50000);
}

// Runs f(first, count) over [0, n) in steps of kStepBytes, letting the piece in flight move
// between them: a leader that copied or reduced a whole piece at once would leave its links
// idle for that long.
template <typename F>
void Collectives::in_steps(size_t n, size_t esz, F f) {
  size_t step = std::max<size_t>(1, kStepBytes / esz);
  for (size_t lo = 0; lo < n; lo += step) {
    f(lo, std::min(step, n - lo));
    if (net_[0].active || net_[1].active) net_advance(0);
  }
}

void Collectives::node_pipelined_allreduce(const Work& w, double divisor) {
  // Several ranks on some node (this one may have only one: then it reduces in its buffer), several
  // nodes. Pieces of half a slot, alternating between the two halves of every slot and of the
  // reduce area: piece j is copied in and reduced while piece j-1 crosses the links; then piece j
  // starts crossing beside piece j-1's gather, and piece j-1 is copied back once it has crossed.
  // Three barriers a piece: the node's copies are in, the node's sum is complete, piece j-1 has
  // crossed.
  int L = topo_.local_size(), local = topo_.local;
  bool leader = topo_.is_leader();
  size_t esz = dtype_size(w.dtype);
  size_t half = std::max<size_t>(1, chunk_bytes_ / esz / 2);
  size_t P = (w.count + half - 1) / half;
  net_[0].active = net_[1].active = false;
  if (P == 0) return;  // nothing to reduce (every rank knows: the counts agree or were refused)
  // In a barrier the leader moves the pieces in flight; once none is left, it waits as everyone does.
  std::function<bool()> move_links = [this] { return !net_advance(kNetWaitUs); };
  auto in_flight = [&] { return leader && (net_[0].active || net_[1].active) ? &move_links : nullptr; };
  auto span = [&](size_t j) { return std::min(half, w.count - j * half); };
  auto red_of = [&](size_t j) { return L > 1 ? shm_.red_area() + (j & 1) * half * esz : w.buf + j * half * esz; };
  auto copy_back = [&](size_t j) {
    char* user = w.buf + j * half * esz;
    char* red = red_of(j);
    if (red == user && divisor == 1.0) return;
    in_steps(span(j), esz, [&](size_t lo, size_t c) {
      copy_scaled(w.dtype, user + lo * esz, red + lo * esz, c, divisor);
    });
  };
  for (size_t j = 0; j < P; ++j) {
    size_t off = j * half, n = span(j);
    char* user = w.buf + off * esz;
    char* red = red_of(j);
    int set = int(j & 1), before = set ^ 1;
    if (L > 1) {
      // Only the parts other ranks reduce go through shared memory; this rank reads its own
      // part straight from its buffer (saves 1/L of the copy-in).
      size_t p0 = n * size_t(local) / size_t(L), p1 = n * size_t(local + 1) / size_t(L);
      size_t half_off = size_t(set) * half * esz;
      char* slot = shm_.slot(local) + half_off;
      in_steps(p0, esz, [&](size_t lo, size_t c) { std::memcpy(slot + lo * esz, user + lo * esz, c * esz); });
      in_steps(n - p1, esz, [&](size_t lo, size_t c) {
        std::memcpy(slot + (p1 + lo) * esz, user + (p1 + lo) * esz, c * esz);
      });
      if (j == 0) shm_.publish_desc(w, 2);
      shm_.barrier(in_flight());
      if (j == 0) shm_.check_descs(2);
      in_steps(p1 - p0, esz, [&](size_t lo, size_t c) {
        // srcs_ again each step: the leader's reduce_shard between steps (net_advance) uses it too
        for (int l = 0; l < L; ++l) srcs_[l] = shm_.slot(l) + half_off + (p0 + lo) * esz;
        srcs_[local] = user + (p0 + lo) * esz;
        reduce_many(w.dtype, w.op, red + (p0 + lo) * esz, srcs_.data(), L, c);
      });
      shm_.barrier(in_flight());  // the node's sum of piece j is complete
    }
    if (leader) {
      net_until_gathering(before);  // every node posts piece j-1's gather before piece j's scatter
      net_start(w, red, off, n, set);
      net_finish(before);  // piece j moves meanwhile
    }
    if (j == 0) continue;
    if (L > 1) shm_.barrier(in_flight());  // piece j-1 has crossed
    copy_back(j - 1);
  }
  if (leader) net_finish(int((P - 1) & 1));
  if (L > 1) shm_.barrier();
  copy_back(P - 1);
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
  if (N > 1) return node_pipelined_allreduce(w, divisor);
  // One node, several ranks.
  for (size_t off = 0; off < w.count; off += chunk) {
    size_t n = std::min(chunk, w.count - off);
    char* user = w.buf + off * esz;
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
    char* red = shm_.red_area();
    reduce_many(w.dtype, w.op, red + p0 * esz, srcs_.data(), L, p1 - p0);
    shm_.barrier();
    copy_scaled(w.dtype, user, red, n, divisor);
  }
}

}  // namespace sdp
