// The collectives, written against the peer links (post send / post receive / exchange or
// progress) and the shared-memory node (slots, barrier, descriptions) only: no socket, no
// thread, no queue.
// One file per family: allreduce.cpp, broadcast.cpp, allgather.cpp, reducescatter.cpp, barrier.cpp,
// gather_scatter.cpp.
#pragma once
#include <atomic>
#include <cstddef>
#include <vector>

#include "sdp/frame.h"
#include "sdp/group.h"
#include "sdp/peer.h"
#include "sdp/shm_node.h"

namespace sdp {

class Collectives {
 public:
  Collectives(const Topology& topo, OpState& op, Links& links, ShmNode& shm)
      : topo_(topo), op_(op), links_(links), shm_(shm) {}
  void configure(size_t chunk_bytes, int pipeline_depth) {
    chunk_bytes_ = chunk_bytes;
    pipeline_depth_ = pipeline_depth;
  }
  // After set-up: the receive buffers, touched once now, not during the first collective.
  void start();

  void all_reduce(const Work& w);
  void broadcast(const Work& w);
  // In place on world_size blocks of w.count elements (see Coll).
  void all_gather(const Work& w);
  void reduce_scatter(const Work& w);
  // A group of one rank: the in-place collectives leave the buffer as it is, the others copy.
  void one_rank(const Work& w);
  // The blocks between ranks of one node (gather_scatter.cpp; see Coll).
  void gather(const Work& w);
  void scatter(const Work& w);
  void all_to_all(const Work& w);
  void barrier(const Work& w);  // barrier.cpp
  uint64_t peer_read_bytes() const { return peer_read_bytes_.load(std::memory_order_relaxed); }

 private:
  // Every node has exactly one rank: the paths that keep the data in the user's buffer. Decided
  // from the whole layout, never from this node's size alone, so every node takes the same path.
  bool one_rank_per_node() const { return topo_.world_size() == topo_.num_nodes(); }
  // all_reduce across nodes (allreduce.cpp)
  void node_pipelined_allreduce(const Work& w, double divisor);
  void pipelined_allreduce(const Work& w, double divisor);
  // Pieces of the node's sum across the links (net_, at most two: the older one's gather and the
  // newer one's scatter travel together), moved in steps. net_advance(wait_us): one step (waiting
  // up to wait_us for the sockets); true when no piece is left in flight.
  void net_start(const Work& w, char* red, size_t off, size_t n, int set);
  bool net_advance(int wait_us);
  void net_until_gathering(int set);  // that piece's gather is posted
  void net_finish(int set);           // that piece has crossed
  template <typename F>
  void in_steps(size_t n, size_t esz, F f);
  void small_tcp_allreduce(const Work& w, double divisor);
  void post_scatter(const FrameHeader& base, char* red, size_t off, size_t n, int set);
  void post_gather(const FrameHeader& base, char* red, size_t off, size_t n);
  void reduce_shard(const Work& w, char* red, size_t n, int set);
  size_t recv_slot_bytes() const;
  // reduce_scatter paths (reducescatter.cpp)
  void node_reduce_scatter(const Work& w, double divisor);
  void tcp_reduce_scatter(const Work& w, double divisor);
  char* recv_slot(int set, int k);
  // gather (one node) and scatter (the root's node) (gather_scatter.cpp)
  void rooted(const Work& w, bool to_root);
  // Large gather, scatter and all_to_all read straight from the peers' memory (Linux cross-memory
  // attach, one copy instead of two through the slots), when a probe on first use shows every
  // local rank can read every other (not with Yama ptrace_scope >= 1, separate PID namespaces or
  // SDP_NO_CMA=1). Publishes this rank's record (pid, `addrs`) and the description, checks them;
  // false: every local rank takes the slot path.
  bool single_copy(const Work& w, const std::vector<const char*>& addrs);
  bool probe_single_copy();
  // Reads `bytes` at `addr` of local rank l's process into `dst`; fails the collective if it cannot.
  void read_peer(int l, const char* addr, char* dst, size_t bytes);
  // Field i of local rank l's record in its slot (pid, &nonce_, nonce_, probe verdict, addresses).
  uint64_t rec(int l, size_t i) const;
  void set_rec(size_t i, uint64_t v);
  // The i-th address local rank l published in its record (what it lets peers read).
  const char* peer_addr(int l, size_t i) const;

  const Topology& topo_;
  OpState& op_;
  Links& links_;
  ShmNode& shm_;
  size_t chunk_bytes_ = 4 << 20;
  int pipeline_depth_ = 2;          // chunks in flight on the TCP path (SDP_PIPELINE_DEPTH: 1 or 2)
  std::vector<char> recv_buf_;      // leader: one shard-sized buffer per peer node, two sets
  std::vector<char> small_buf_;     // one rank per node: N+1 small buffers (peers' data, the sum)
  std::vector<const void*> srcs_;
  struct NetPiece {
    const Work* w = nullptr;
    char* red = nullptr;
    size_t off = 0, n = 0;
    int set = 0, phase = 0;  // phase 0: shards going out to their nodes; 1: the sums coming back
    bool active = false;
  } net_[2];  // by set (piece j uses set j & 1)
  int net_older_ = 0;  // the set of the older piece in flight
  // What the leader copies or reduces between two steps of the piece in flight, and how long it
  // waits for its sockets inside a barrier (then looks at the barrier again).
  static constexpr size_t kStepBytes = 256 << 10;
  static constexpr int kNetWaitUs = 200;
  std::vector<char> rs_buf_;        // one rank per node: the other nodes' blocks for this rank
  int small_set_ = 0;
  int single_copy_ = -1;            // -1: not probed yet; 0: the slots; 1: cross-memory reads
  bool no_cma_ = false;             // SDP_NO_CMA: this rank votes for the slots
  uint64_t nonce_ = 0;              // what peers must read at &nonce_ for the probe to pass
  std::atomic<uint64_t> peer_read_bytes_{0};
};

}  // namespace sdp
