// The engine: one per process group on each rank.
//
// Topology. Ranks are grouped into nodes. Within a node, ranks meet in one shared-memory
// segment: each copies its chunk into its own slot, then every rank reduces an equal part of
// the chunk across all slots (a balanced intra-node reduce). Across nodes, only the node's
// leader (its first rank) talks TCP: the node-reduced chunk is split into one equal shard per
// node, node k sums shard k from every node and sends the sum back (every node serves one
// shard, parameter-server style, with no extra machines). So one copy per node crosses the
// network and no node does more reduction work than another.
//
// Progress. Collectives are queued and executed in order by a progress thread; the caller
// gets a handle at once and waits on it later (with the GIL released by the binding).
//
// Safety. Every collective is described (sequence, collective, dtype, op, count, root) to the
// other ranks before anything is reduced; a mismatch fails every rank with the differing field.
// Every wait has a deadline. A rank that dies or closes its connections is detected through its
// sockets and named in the error that every other rank raises. After an error the engine is
// broken: every later call fails with the first error.
//
// Layers: frame.h (what travels), peer.h (links to other nodes' leaders), shm_node.h (the
// node's shared memory), collectives.h (the algorithms, against those two only), engine_setup.h
// (connecting the ranks, and the liveness sockets of a node's ranks). The engine itself holds
// the queue, the progress thread, the first-error latch and the lifecycle.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sdp/collectives.h"
#include "sdp/common.h"
#include "sdp/engine_setup.h"
#include "sdp/flight.h"
#include "sdp/frame.h"
#include "sdp/group.h"
#include "sdp/peer.h"
#include "sdp/shm_node.h"
#include "sdp/transport.h"

namespace sdp {

struct EngineConfig {
  int rank = 0;
  std::vector<int> node_of_rank;  // node index (0..N-1) of every rank of the group
  std::string secret;
  std::string bind_addr = "127.0.0.1";
  double timeout_s = 300.0;
  size_t chunk_bytes = 4 << 20;
  int spin = -1;  // pause-loop iterations before sleeping in a node barrier (-1: default, 2000)
};

struct Stats {
  uint64_t collectives = 0;
  uint64_t bytes = 0;        // bytes of user data reduced or broadcast
  double busy_s = 0;         // time the progress thread spent executing collectives
  uint64_t peer_read_bytes = 0;  // bytes read straight from local peers' memory (single-copy path)
};

class Engine : private OpState {
 public:
  explicit Engine(EngineConfig cfg);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Set-up, in two steps around a store exchange done by the caller:
  // 1) prepare(): a node leader creates the node's shared memory and starts listening.
  //    It returns the port (0 for non-leaders) and the shared-memory name to publish.
  // 2) connect(): with every node's leader address/port. Local ranks learn the node's shared
  //    memory from their leader over the authenticated connection, never from the store.
  std::pair<int, std::string> prepare(PortRange ports = {});
  void connect(const std::vector<std::string>& leader_addrs, const std::vector<int>& leader_ports);

  uint64_t submit(Coll c, void* buf, size_t count, DType t, ReduceOp op, int root, const void* src = nullptr,
                  std::vector<char*> blocks = {});
  // Blocks until the handle's collective finished; throws Error if it (or an earlier one) failed.
  void wait(uint64_t handle, double timeout_s);
  bool test(uint64_t handle);
  void shutdown();
  // A failure this rank saw outside the engine (a message whose peer died, sdp_jupyter.comm): the
  // engine fails with it at its next health check, and passes it to the node's ranks and to the
  // other nodes as the first error, so that every rank names the cause and none blames this
  // rank's exit that follows. Safe from any thread.
  void report(const std::string& msg);

  int rank() const { return cfg_.rank; }
  int world_size() const { return topo_.world_size(); }
  int node() const { return topo_.node; }
  int num_nodes() const { return topo_.num_nodes(); }
  int local_rank() const { return topo_.local; }
  int local_size() const { return topo_.local_size(); }
  bool is_leader() const { return topo_.is_leader(); }
  int listen_port() const { return conns_.port(); }
  std::string broken_message();
  Stats stats();
  // The flight recorder's newest `last` entries (all when 0), oldest first (flight.h).
  std::vector<FlightEntry> flight(size_t last = 0);

 private:
  void progress_loop();
  void execute_front(std::unique_lock<std::mutex>& lk);
  void run(const Work& w);
  [[noreturn]] void fail(const std::string& msg, bool remote = false) override;
  void check_health(const std::function<bool()>* settled = nullptr) override;
  void idle_check();

  EngineConfig cfg_;
  Topology topo_;
  Links links_;
  ShmNode shm_;
  Collectives colls_;
  Connections conns_;

  // work queue
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Work> queue_;
  uint64_t next_id_ = 1;
  uint64_t completed_ = 0;
  uint64_t failed_from_ = 0;   // first handle that failed (0: none)
  std::string broken_;
  bool stopping_ = false;
  bool busy_ = false;          // a thread is executing a collective or an idle check
  bool connected_ = false;
  std::thread progress_;
  std::mutex shutdown_mu_;  // shutdown() runs once at a time
  Stats stats_;
  FlightRing flight_;  // written with mu_ held
  std::mutex report_mu_;
  std::string reported_;
  std::atomic<bool> has_report_{false};
  bool shm_published() {
    std::string m;
    bool remote = false;
    return shm_.active() && shm_.published_error(&m, &remote);
  }
};

}  // namespace sdp
