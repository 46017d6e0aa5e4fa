// Who is who in a process group, and the collective in progress: what the peer links, the
// shared-memory node and the collectives share so that every error names the right ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sdp {

struct Work;

struct Topology {
  int rank = 0;
  std::vector<int> node_of_rank;               // node index of every rank
  std::vector<std::vector<int>> ranks_of_node;  // the ranks of every node, leader first
  std::vector<std::string> node_addrs;          // each node leader's address, for messages
  int node = 0, local = 0;

  // Throws Error on a layout that is not nodes 0..N-1 each with at least one rank.
  Topology(int rank, std::vector<int> node_of_rank);
  int world_size() const { return int(node_of_rank.size()); }
  int num_nodes() const { return int(ranks_of_node.size()); }
  int local_size() const { return int(ranks_of_node[node].size()); }
  bool is_leader() const { return local == 0; }
  int leader_of(int n) const { return ranks_of_node[n][0]; }
  // "rank 5 (node 2 at 10.0.0.3)"
  std::string rank_name(int r) const;
  // "node 2 at 10.0.0.3" (as in rank_name: the address when known, and not loopback for this node)
  std::string node_name(int n) const;
  static std::string ranks_list(const std::vector<int>& ranks);
};

// The collective being executed and how to fail it. The engine implements it: a failure is
// latched once (the first error wins on every local rank and goes to the other nodes).
class OpState {
 public:
  virtual ~OpState() = default;
  // The running collective (null when idle). Its description ("all_reduce #12 (...)") is built
  // only when an error needs it: formatting text on every collective cost an allocation and, in
  // a build that carried its own copy of the C++ runtime, crashed beside torch's (locale code).
  const Work* running = nullptr;
  uint64_t seq = 0;       // its sequence number
  std::string desc() const;  // describe(*running, seq), "" when idle
  double deadline = 0;    // when it times out (now_s() clock)
  double timeout_s = 0;   // the configured per-collective timeout, for messages
  [[noreturn]] virtual void fail(const std::string& msg, bool remote = false) = 0;
  // Raises the node's published error, or a local rank that died or left; unless `settled` is
  // given and says the wait that asked is over by now (a rank that passed a barrier every rank
  // reached may finish and shut down before a slow peer wakes: that must not fail the barrier).
  virtual void check_health(const std::function<bool()>* settled = nullptr) = 0;
};

// "2.5", "300", "0.001": a number of seconds for a message (printf's %g; no iostreams).
std::string fmt_seconds(double s);

}  // namespace sdp
