#include "sdp/group.h"

#include <algorithm>
#include <cstdio>

#include "sdp/common.h"
#include "sdp/frame.h"

namespace sdp {

Topology::Topology(int r, std::vector<int> nodes) : rank(r), node_of_rank(std::move(nodes)) {
  int w = int(node_of_rank.size());
  if (w <= 0) throw Error("world size must be at least 1");
  if (rank < 0 || rank >= w) throw Error("rank " + std::to_string(rank) + " outside world of " + std::to_string(w));
  int nn = 0;
  for (int n : node_of_rank) {
    if (n < 0) throw Error("negative node index");
    nn = std::max(nn, n + 1);
  }
  ranks_of_node.assign(nn, {});
  for (int q = 0; q < w; ++q) ranks_of_node[node_of_rank[q]].push_back(q);
  for (int n = 0; n < nn; ++n)
    if (ranks_of_node[n].empty()) throw Error("node " + std::to_string(n) + " has no ranks: node indices must be 0..N-1");
  node = node_of_rank[rank];
  auto& mine = ranks_of_node[node];
  local = int(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

// Nodes are named with their host's address: "the host is unreachable" is what a user needs to know
// when a link fails, and which host a dead rank was on when a job spans hosts. A loopback address says
// nothing about this rank's own node; another node's is kept (it tells a link from a local failure).
static std::string node_label(const Topology& t, int n, bool loopback_too) {
  std::string s = "node " + std::to_string(n);
  bool known = size_t(n) < t.node_addrs.size() && !t.node_addrs[n].empty();
  if (known && (loopback_too || t.node_addrs[n].rfind("127.", 0) != 0)) s += " at " + t.node_addrs[n];
  return s;
}

std::string Topology::rank_name(int r) const {
  int n = node_of_rank[r];
  return "rank " + std::to_string(r) + " (" + node_label(*this, n, n != node) + ")";
}

std::string Topology::node_name(int n) const { return node_label(*this, n, n != node); }

std::string Topology::ranks_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

std::string OpState::desc() const { return running ? describe(*running, seq) : std::string(); }

}  // namespace sdp
