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
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sdp/common.h"
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

struct ShmHeader;

struct Stats {
  uint64_t collectives = 0;
  uint64_t bytes = 0;        // bytes of user data reduced or broadcast
  double busy_s = 0;         // time the progress thread spent executing collectives
};

class Engine {
 public:
  explicit Engine(EngineConfig cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Set-up, in two steps around a store exchange done by the caller:
  // 1) prepare(): a node leader creates the node's shared memory and starts listening.
  //    It returns the port (0 for non-leaders) and the shared-memory name to publish.
  // 2) connect(): with every node's leader address/port. Local ranks learn the node's shared
  //    memory from their leader over the authenticated connection, never from the store.
  std::pair<int, std::string> prepare();
  void connect(const std::vector<std::string>& leader_addrs, const std::vector<int>& leader_ports);

  uint64_t submit(Coll c, void* buf, size_t count, DType t, ReduceOp op, int root);
  // Blocks until the handle's collective finished; throws Error if it (or an earlier one) failed.
  void wait(uint64_t handle, double timeout_s);
  bool test(uint64_t handle);
  void shutdown();

  int rank() const { return cfg_.rank; }
  int world_size() const { return int(cfg_.node_of_rank.size()); }
  int node() const { return node_; }
  int num_nodes() const { return int(ranks_of_node_.size()); }
  int local_rank() const { return local_; }
  int local_size() const { return int(ranks_of_node_[node_].size()); }
  bool is_leader() const { return local_ == 0; }
  int listen_port() const { return port_; }
  std::string broken_message();
  Stats stats();

 private:
  struct Work {
    uint64_t id;
    Coll coll;
    char* buf;
    size_t count;
    DType dtype;
    ReduceOp op;
    int root;
  };
  struct Peer {  // a TCP connection to another node's leader
    int fd = -1;
    int node = -1;
    int rank = -1;
    bool bye = false;
    // an outgoing frame in flight
    bool send_active = false;
    FrameHeader shdr{};
    const char* sdata = nullptr;
    size_t slen = 0, sdone = 0;  // sdone counts header bytes too
    // an incoming frame expected
    bool recv_active = false;
    FrameHeader expect{};
    char* rdata = nullptr;
    size_t rhdr_done = 0, rdone = 0;
    FrameHeader rhdr{};
    // frames posted behind the active ones (the pipelined path keeps several in flight), in
    // the order they go on the wire; every rank posts in the same order, so the order of
    // the receives matches the order of the peer's sends
    struct Out { FrameHeader h; const char* data; };
    struct In { FrameHeader expect; char* dst; };
    std::deque<Out> sendq;
    std::deque<In> recvq;
    uint64_t recvs_posted = 0, recvs_done = 0;
    uint64_t scatter_mark[2] = {0, 0};  // recvs_posted after the scatter into each receive set
  };

  void progress_loop();
  void execute_front(std::unique_lock<std::mutex>& lk);
  void acceptor_loop();
  void run(const Work& w);
  void run_allreduce(const Work& w);
  void run_broadcast(const Work& w);
  void inter_node_allreduce(const Work& w, char* red, size_t off, size_t n);
  void pipelined_allreduce(const Work& w, double divisor);
  void small_tcp_allreduce(const Work& w, double divisor);
  FrameHeader frame_base(const Work& w) const;
  void post_scatter(const FrameHeader& base, char* red, size_t off, size_t n, int set);
  void post_gather(const FrameHeader& base, char* red, size_t off, size_t n);
  void reduce_shard(const Work& w, char* red, size_t n, int set);
  void post_send(Peer& p, const FrameHeader& h, const char* data);
  void post_recv(Peer& p, const FrameHeader& expect, char* dst);
  size_t recv_slot_bytes() const;
  char* recv_slot(int set, int k);
  void node_barrier();
  void exchange(int scatter_set = -1);
  bool pump_send(Peer& p);
  bool pump_recv(Peer& p);
  void check_frame(const Peer& p);
  void check_health();
  void check_deadline(const std::string& waiting_for);
  [[noreturn]] void fail(const std::string& msg, bool remote = false);
  void send_error_frames(const std::string& msg);
  void publish_desc(const Work& w, int set);
  void check_descs(const Work& w, int set);
  std::string rank_name(int r) const;
  std::string ranks_list(const std::vector<int>& ranks) const;
  char* slot(int local) const;
  char* red_area() const;
  char* small_slot(int set, int local) const;
  void idle_check();

  EngineConfig cfg_;
  std::vector<std::vector<int>> ranks_of_node_;
  std::vector<std::string> node_addrs_;  // each node leader's address, for messages
  int node_ = 0, local_ = 0, port_ = 0;
  int listen_fd_ = -1;
  std::string shm_name_;
  ShmHeader* shm_ = nullptr;
  size_t shm_size_ = 0;
  char* shm_data_ = nullptr;
  std::vector<Peer> peers_;          // by node index (own node unused)
  std::vector<int> local_fds_;       // leader: liveness sockets of the other local ranks, by local index
  std::vector<bool> local_gone_;     // leader: local rank said goodbye
  int leader_fd_ = -1;               // non-leader: liveness socket to the node leader
  std::vector<char> recv_buf_;       // leader: one shard-sized buffer per peer node
  std::vector<char> small_buf_;      // one rank per node: N+1 small buffers (peers' data, the sum)
  std::vector<const void*> srcs_;
  uint64_t barrier_count_ = 0;
  int spin_ = 0;                     // cfg_.spin resolved
  bool yield_ = false;               // sched_yield stage in barriers
  int pipeline_depth_ = 2;           // chunks in flight on the TCP path (SDP_PIPELINE_DEPTH: 1 or 2)
  int small_set_ = 0;
  uint64_t seq_ = 0;                 // sequence number of the collective being executed
  std::string cur_desc_;             // "all_reduce #12 (1000 x float32, SUM)" for messages
  double op_deadline_ = 0;
  bool error_frames_sent_ = false;

  // set-up hand-off from the acceptor thread
  std::mutex accept_mu_;
  std::condition_variable accept_cv_;
  std::vector<std::pair<PeerIdentity, int>> accepted_;
  std::atomic<bool> setup_done_{false};
  std::thread acceptor_;

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
  Stats stats_;
};

}  // namespace sdp
