// The ranks of one node meet in one shared-memory segment: a slot per rank for chunks, a
// reduce area, small slots for the one-barrier path, a barrier, the collective descriptions
// every rank checks before anything is reduced, and the node's error slot (the first error
// wins and every local rank reports it).
//
// The leader creates the segment and offers it to each local rank over their authenticated
// connection (name, exact size, random token); a rank maps it only if it is this user's,
// 0600, of the offered size and holds the token. Nothing of this goes through the store.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "sdp/frame.h"
#include "sdp/group.h"

namespace sdp {

constexpr int kMaxLocal = 256;
// All-reduces up to this size take one-exchange paths: within a node every rank sums all small
// slots itself (two slot sets, so one barrier suffices); across nodes every node sends its
// whole buffer to every other.
constexpr size_t kSmallBytes = 64 << 10;

#pragma pack(push, 1)
struct ShmOffer {
  uint32_t magic;
  char name[64];
  uint8_t token[16];
  uint64_t size;
};
#pragma pack(pop)

struct ShmHeader;

class ShmNode {
 public:
  ShmNode(const Topology& topo, OpState& op) : topo_(topo), op_(op) {}
  ~ShmNode() { unmap(); }
  ShmNode(const ShmNode&) = delete;
  ShmNode& operator=(const ShmNode&) = delete;

  void configure(size_t chunk_bytes, int spin) {
    chunk_bytes_ = chunk_bytes;
    spin_ = spin;
    yield_ = spin > 0;
  }
  bool active() const { return hdr_ != nullptr; }
  const std::string& name() const { return name_; }
  // Leader: creates the segment (removing this user's segments whose leader is gone first).
  void create();
  ShmOffer offer() const;
  // Local rank: reads the leader's offer from `fd` and maps the segment it names, if it is ours.
  void map_offered(int fd, double deadline);
  // Leader, once every local rank mapped the segment (nothing is left in /dev/shm), or when
  // set-up failed. Does nothing once done.
  void unlink();
  void unmap();

  char* slot(int local) const { return data_ + size_t(local) * chunk_bytes_; }
  char* red_area() const { return slot(topo_.local_size()); }
  char* small_slot(int set, int local) const {
    return slot(topo_.local_size() + 1) + (size_t(set) * size_t(topo_.local_size()) + size_t(local)) * kSmallBytes;
  }

  // Waits for every local rank (spin, yield, then futex sleep with health and deadline checks).
  // With `while_waiting` (a leader with frames in flight) it calls that instead of sleeping: the
  // callee waits briefly for its own events (Links::progress polls its sockets), so the links
  // keep moving while the node gathers; once it returns false (nothing left in flight) the
  // barrier waits as usual.
  void barrier(const std::function<bool()>* while_waiting = nullptr);
  // Descriptions live in set 0 or 1 (the alternating one-barrier path) or 2 (everything else).
  void publish_desc(const Work& w, int set);
  // Fails every local rank alike when any two descriptions differ.
  void check_descs(int set);

  // The error slot. latch_error publishes `msg` if no local rank did before and returns it;
  // otherwise waits (bounded) for the winner's message and returns that (remote set from it).
  std::string latch_error(const std::string& msg, bool* remote);
  // The node's published error, if any.
  bool published_error(std::string* msg, bool* remote) const;

 private:
  const Topology& topo_;
  OpState& op_;
  size_t chunk_bytes_ = 4 << 20;
  int spin_ = 2000;
  bool yield_ = true;
  std::string name_;
  ShmHeader* hdr_ = nullptr;
  size_t size_ = 0;
  char* data_ = nullptr;
  uint64_t barrier_count_ = 0;
};

}  // namespace sdp
