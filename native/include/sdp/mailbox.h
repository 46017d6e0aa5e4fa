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
// Matching is MPI's: a message goes to the oldest posted receive whose source (or "any") and
// tag fit; a message nobody waits for yet is kept until a receive takes it, except that one over
// kSpinMaxBytes arriving while no receive from its sender is posted stays in the socket until one
// is (parked: no fresh buffer to fill and copy again; its send completes when the receiver
// posts, as gloo's do). A receive whose size differs from the message fails naming both sizes.
// Every wait has a deadline; a wait that times out withdraws its operation, and a rank that
// closes its connection fails the receives that wait for it, naming it.
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

class Mailbox {
 public:
  // spin: a receive reading its connection polls before it sleeps (SpinWindow; SDP_SPIN=0 turns it off).
  Mailbox(int rank, int world_size, std::string secret, std::string bind_addr, double timeout_s, bool spin = true);
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Opens this rank's listener and starts the threads; returns the port to publish.
  int listen();
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

  struct Op;

 private:
  struct In;
  struct Out;
  void io_loop();
  void accept_loop();
  void pump_in(int src);
  void watch_in(int src, bool on);
  void wait_reading(std::unique_lock<std::mutex>& lk, const Op& op, int src, double deadline);
  void deliver(const std::shared_ptr<Op>& op, int src, const char* data, size_t n);
  void adopt(In& c, int src);
  // The oldest posted receive that a message from `src` with `tag` goes to, or posted_.end() (mu_ held).
  std::deque<std::shared_ptr<Op>>::iterator posted_for(int src, int64_t tag);
  // The same receive, taken out of posted_ (null: none).
  std::shared_ptr<Op> take_posted(int src, int64_t tag);
  void fail_op(const std::shared_ptr<Op>& op, const std::string& why);
  void peer_closed_in(int src, const std::string& why);
  void peer_closed_out(int dst, const std::string& why);
  void wake();
  std::string who(int r) const;

  int rank_, world_;
  std::string secret_, bind_addr_;
  double timeout_s_;
  bool spin_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int ep_ = -1;       // epoll set of the incoming connections the I/O thread reads
  int stop_fd_ = -1;  // eventfd, readable once shutdown starts
  std::vector<char> drain_;  // where the bytes of a dropped message go (mu_ held)
  std::vector<std::string> addrs_;
  std::vector<int> ports_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Op>> ops_;
  uint64_t next_ = 1;
  std::deque<std::shared_ptr<Op>> posted_;  // receives no message has matched yet, oldest first
  struct Unexpected {
    int src;
    int64_t tag;
    std::vector<char> data;
  };
  std::deque<Unexpected> unexpected_;  // messages no receive has taken yet, in arrival order
  std::vector<std::unique_ptr<In>> in_;   // by source rank
  std::vector<std::unique_ptr<Out>> out_;  // by destination rank
  std::mutex connect_mu_;                  // one connection attempt at a time
  std::atomic<bool> stop_{false};
  bool shut_ = false;
  std::thread io_, acceptor_;
};

}  // namespace sdp
