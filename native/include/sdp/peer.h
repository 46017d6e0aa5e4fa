// The TCP links of a node leader to the other nodes' leaders: post a send or a receive of one
// frame, and pump every link until what was posted has moved, under the collective's deadline.
// Sockets are non-blocking and driven by one poll loop, so a peer that cannot take more data
// never holds up the others. Incoming frames are checked against what was expected (the same
// collective, the same bytes) before their payload is accepted.
#pragma once
#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "sdp/frame.h"
#include "sdp/group.h"

namespace sdp {

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
  uint64_t sends_posted = 0, sends_done = 0;
  uint64_t scatter_mark[2] = {0, 0};  // recvs_posted after the scatter into each receive set
  // recvs_posted and sends_posted after the gather of each set (Links::mark_done)
  uint64_t done_recvs[2] = {0, 0}, done_sends[2] = {0, 0};
};

class Links {
 public:
  Links(const Topology& topo, OpState& op) : topo_(topo), op_(op), peers_(topo.num_nodes()) {}
  Peer& operator[](int node) { return peers_[node]; }
  std::vector<Peer>& all() { return peers_; }

  // A DATA header for the running collective with this rank as the sender.
  FrameHeader frame_base(const Work& w) const;
  void post_send(int node, const FrameHeader& h, const char* data);
  void post_recv(int node, const FrameHeader& expect, char* dst);
  // Marks the receives posted so far to `node` as receive set `set` (see exchange()).
  void mark_scatter(int node, int set) { peers_[node].scatter_mark[set] = peers_[node].recvs_posted; }
  // Moves every posted frame until the receives marked as set `scatter_set` have arrived from
  // every peer (with -1: until every posted frame, sends included, is done).
  void exchange(int scatter_set = -1);
  // Marks every frame posted so far, both ways, as the end of set `set` (see done()).
  void mark_done(int set);
  // One step of exchange() that returns instead of waiting: moves what the sockets take now and,
  // if `wait_us` > 0 and frames are left, waits up to that long for a socket and moves again.
  // Checks health and the deadline as exchange() does.
  void step(int wait_us);
  // Whether the receives marked as scatter set `set` have arrived from every peer, and whether
  // every frame up to set `set`'s mark_done() has moved both ways.
  bool scattered(int set) const;
  bool done(int set) const;

  // After set-up: non-blocking, bulk buffers, keepalive.
  void start(double timeout_s);
  // Whether exchange() polls before it sleeps while the frames in flight are small
  // (SDP_SPIN > 0, the default; see kSpinMaxBytes).
  void set_spin(bool on) { spin_ = on; }
  // Finishes the frame in flight on every link and sends an ERROR frame with `msg` (once).
  void send_error_frames(const std::string& msg);
  // Between collectives: raise a peer's error frame or lost connection; note goodbyes.
  void idle_check();
  // Says goodbye to every peer (bounded by `deadline`) and closes the links.
  void close_all(double deadline);

 private:
  // Pumps every link once; true when the goal of exchange(scatter_set) is reached. Fills
  // pfds/who with the links that still wait for their sockets.
  bool pump_all(int scatter_set, std::vector<pollfd>& pfds, std::vector<Peer*>& who);
  // After a poll that timed out: a peer's error, a dead local rank, or the deadline.
  void check_stalled(const std::vector<Peer*>& who);
  bool pump_send(Peer& p);
  bool pump_recv(Peer& p);
  // A send to `p` failed: raise the ERROR frame `p` wrote before it closed, if one is waiting (the
  // cause, when `p` failed because a third rank died); returns when there is none.
  void raise_cause_from(Peer& p);
  void check_frame(const Peer& p);

  const Topology& topo_;
  OpState& op_;
  std::vector<Peer> peers_;  // by node index (own node unused)
  std::vector<pollfd> pfds_;  // step()'s, kept between calls (no allocation per step)
  std::vector<Peer*> who_;
  bool error_frames_sent_ = false;
  bool spin_ = true;
};

}  // namespace sdp
