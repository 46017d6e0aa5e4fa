// How the engine's ranks find each other and notice each other leaving: the node leader's
// listener and acceptor, the authenticated connections of set-up (leaders to leaders, local ranks
// to their leader, who hands them the node's shared memory), and the liveness sockets that stay
// open between a local rank and its leader (probed between and during collectives; a clean
// goodbye is one byte 'B').
//
// Set-up, in two steps around a store exchange done by the caller (Engine::prepare/connect):
// 1) prepare(): a node leader creates the node's shared memory and starts listening if anyone
//    will connect; the port to publish (0 for the others).
// 2) connect(): with every node's leader address/port. Lower nodes' leaders and this node's
//    ranks connect to their leader; a leader connects to the higher nodes' leaders. Local ranks
//    learn the node's shared memory from their leader over the authenticated connection, never
//    from the store.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sdp/group.h"
#include "sdp/peer.h"
#include "sdp/shm_node.h"
#include "sdp/transport.h"

namespace sdp {

class Connections {
 public:
  Connections(Topology& topo, OpState& op, Links& links, ShmNode& shm, std::string secret, double timeout_s)
      : topo_(topo), op_(op), links_(links), shm_(shm), secret_(std::move(secret)), timeout_s_(timeout_s),
        local_fds_(size_t(topo.local_size()), -1), local_gone_(size_t(topo.local_size()), false) {}
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  int prepare(const std::string& bind_addr, PortRange ports = {});
  // Returns once every connection of this rank is made, the links are started and the node's
  // shared memory is mapped everywhere (and unlinked); throws Error naming who did not come.
  void connect(const std::vector<std::string>& leader_addrs, const std::vector<int>& leader_ports);
  int port() const { return port_; }

  // Raises (op.fail) a local rank that exited or closed its liveness socket: the leader checks its
  // local ranks, a local rank its leader. Notes a clean goodbye.
  void check_local_ranks(const std::function<bool()>* settled = nullptr);

  // The acceptor gives up (the engine stops); the listener closes with it.
  void stop_accepting() { stopping_.store(true); }
  bool accepting() const { return acceptor_.joinable(); }
  // Joins the acceptor, says goodbye to the other nodes' leaders (Links::close_all) and to this
  // node's leader (bounded by `deadline`), closes every socket of set-up.
  void close(double deadline);

 private:
  void acceptor_loop();
  void accept_peers(double deadline);

  Topology& topo_;
  OpState& op_;
  Links& links_;
  ShmNode& shm_;
  std::string secret_;
  double timeout_s_;
  int port_ = 0;
  int listen_fd_ = -1;
  std::vector<int> local_fds_;    // leader: liveness sockets of the other local ranks, by local index
  std::vector<bool> local_gone_;  // leader: local rank said goodbye
  int leader_fd_ = -1;            // non-leader: liveness socket to the node leader
  bool leader_gone_ = false;      // non-leader: the leader said goodbye

  // set-up hand-off from the acceptor thread
  std::mutex accept_mu_;
  std::condition_variable accept_cv_;
  std::vector<std::pair<PeerIdentity, int>> accepted_;
  std::atomic<bool> setup_done_{false}, stopping_{false};
  std::thread acceptor_;
};

}  // namespace sdp
