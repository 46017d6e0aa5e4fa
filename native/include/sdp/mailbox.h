// Point-to-point messages between any two ranks of a group: send and receive with tags,
// receives from any source, asynchronous handles with deadlines.
//
// Unlike the collectives, a message involves two ranks only, so it cannot ride the engine's
// ordered queue. Every rank has a listener for the group's life; the first message from rank a
// to rank b opens one authenticated connection a -> b (the same handshake as the engine's
// links, role P2P), which then carries every later a -> b message in order. One I/O thread per
// rank moves the bytes with non-blocking sockets and one poll loop; a small receive (up to
// kSpinMaxBytes) that waits for one rank reads that rank's connection in its own thread
// meanwhile (no thread hand-off; see wait_reading).
//
// Matching is MPI's and lives apart from the sockets, in matching.h (posted receives, kept
// messages, any-source, tags, parking, sizes, a sender that left): this file only moves bytes and
// tells the matcher what arrived. Every wait has a deadline; a wait that times out withdraws its
// operation, and a rank that closes its connection fails the receives that wait for it, naming it.
//
// Why not on the collectives' framed links (peer.h)? The connections here are already
// authenticated with the same handshake (transport.h, role P2P). Links exist only between node
// leaders, carry only frames the running collective posted (an unsolicited one is a protocol
// error that breaks the engine), and are pumped by the collective's thread under its deadline:
// messages on them would need links between every pair of ranks, a demultiplexer in front of the
// collectives' checks, and a lock on every frame, and a large message would hold up an all_reduce
// on the same stream (and the other way round). See docs/engine.md.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sdp/matching.h"
#include "sdp/transport.h"

namespace sdp {

constexpr uint32_t kMessageMagic = 0x4d504453;  // "SDPM"

#pragma pack(push, 1)
struct MessageHeader {
  uint32_t magic;
  uint32_t src_rank;
  int64_t tag;
  uint64_t nbytes;
};
#pragma pack(pop)

class Mailbox : private MatchEvents {
 public:
  // spin: a receive reading its connection polls before it sleeps (SpinWindow; SDP_SPIN=0 turns it off).
  Mailbox(int rank, int world_size, std::string secret, std::string bind_addr, double timeout_s, bool spin = true);
  ~Mailbox() override;
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Opens this rank's listener and starts the threads; returns the port to publish.
  int listen(PortRange ports = {});
  // Every rank's listener (index = rank), from the rendezvous.
  void set_peers(std::vector<std::string> addrs, std::vector<int> ports);

  // Both return a handle at once; the buffer must stay valid until the handle completes.
  uint64_t isend(int dst, int64_t tag, const void* data, size_t nbytes);
  uint64_t irecv(int src, int64_t tag, void* data, size_t nbytes);  // src -1: any source
  // Blocks (up to timeout_s, 0: the group's timeout) until the handle completes; returns the
  // sender's rank for a receive (this rank for a send). Throws Error on failure or timeout,
  // after which the operation is withdrawn. A handle is forgotten once wait returns or throws.
  int wait(uint64_t handle, double timeout_s);
  bool test(uint64_t handle);
  void shutdown();

 private:
  struct In;
  struct Out;
  void io_loop();
  void accept_loop();
  void pump_in(int src);
  void watch_in(int src, bool on);
  void wait_reading(std::unique_lock<std::mutex>& lk, const MailOp& op, int src, double deadline);
  void peer_closed_in(int src, const std::string& why);
  void peer_closed_out(int dst, const std::string& why);
  void wake();
  // MatchEvents (mu_ held)
  void finished() override { cv_.notify_all(); }
  void resume(int src) override;
  std::string who(int r) const override;

  int rank_, world_;
  std::string secret_, bind_addr_;
  double timeout_s_;
  bool spin_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int ep_ = -1;       // epoll set of the incoming connections the I/O thread reads
  int stop_fd_ = -1;  // eventfd, readable once shutdown starts
  std::vector<std::string> addrs_;
  std::vector<int> ports_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, MailOpPtr> ops_;
  uint64_t next_ = 1;
  Matcher match_;  // posted receives, kept and parked messages (mu_ held)
  std::vector<std::unique_ptr<In>> in_;   // by source rank
  std::vector<std::unique_ptr<Out>> out_;  // by destination rank
  std::mutex connect_mu_;                  // one connection attempt at a time
  std::atomic<bool> stop_{false};
  bool shut_ = false;
  std::thread io_, acceptor_;
};

}  // namespace sdp
