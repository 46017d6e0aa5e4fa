// The mailbox's matching rules (MPI's), apart from any socket or thread: which receive a message
// goes to, what is kept for a later receive, what waits in the socket (parked), what fails and
// with which words. The mailbox (mailbox.h) owns the connections and the threads and tells the
// matcher what arrived; tests/engine/test_mailbox_matching.py drives it with no socket at all.
//
// - A message goes to the oldest posted receive whose source (or "any", -1) and tag fit; so
//   messages of one (source, tag) are taken in the order they were sent (one connection per
//   source keeps them in that order).
// - A message nobody waits for yet is kept (in arrival order) until a receive takes it; a receive
//   takes the oldest kept message that fits before it is posted.
// - A message of over kParkMinBytes that arrives while no receive from its sender (or any) is
//   posted is parked: it stays in the socket until such a receive is posted (no fresh buffer to
//   fill and copy again; its send completes when the receiver posts, as gloo's do).
// - A receive posted while a kept message is still arriving takes it: what arrived is copied, the
//   rest goes straight into the receive's buffer.
// - A receive whose size differs from the message fails naming both sizes; the message is
//   consumed. A withdrawn receive (its wait timed out) drops the rest of its message.
// - A source that has gone fails the receives that wait for it, naming it; a later receive from it
//   fails at once unless a message it sent before is kept.
//
// Not thread-safe: the mailbox calls it with its lock held.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "sdp/common.h"

namespace sdp {

// A message above this that arrives with no receive from its sender posted waits in the socket.
constexpr size_t kParkMinBytes = kSpinMaxBytes;
// Bytes of an unmatched message kept per read, so a receive posted meanwhile takes the rest.
constexpr size_t kSpillStep = 1 << 20;

// One send or receive of the mailbox, from post to completion.
struct MailOp {
  bool send = false;
  int peer = -1;  // destination, or source (-1: any)
  int64_t tag = 0;
  char* data = nullptr;
  size_t nbytes = 0;
  bool finished = false;
  std::string error;  // set with finished when it failed
  int source = -1;    // the sender, once a receive finished
};
using MailOpPtr = std::shared_ptr<MailOp>;

std::string tag_text(int64_t tag);  // "tag 7", as every message error names a tag

// What the matcher tells the part that drives it.
class MatchEvents {
 public:
  virtual ~MatchEvents() = default;
  virtual void finished() = 0;              // an operation finished (or failed): wake its waiter
  virtual void resume(int src) = 0;         // src's parked message may be read now
  virtual std::string who(int rank) const = 0;  // "rank 3 (10.0.0.2)", for messages
};

class Matcher {
 public:
  Matcher(int world_size, MatchEvents& events);

  // A receive (op->peer: the source, -1 any): takes the oldest kept message that fits, else fails
  // if its source has gone, else is posted; a parked message from its source (any: every parked
  // source) is resumed.
  void post(const MailOpPtr& op);
  // A whole message from `src` that needs no reading (a rank sending to itself): to the oldest
  // receive that fits, else kept (copied).
  void deliver_whole(int src, int64_t tag, const char* data, size_t n);

  // A message arriving from `src`, in steps: its header, then where its next bytes go and how
  // many came, until it is complete (an empty one completes in begin). Parked after begin: read
  // nothing more from src until resume.
  void begin(int src, int64_t tag, size_t nbytes);
  bool receiving(int src) const { return in_[size_t(src)].active; }
  bool parked(int src) const { return in_[size_t(src)].parked; }
  struct Space {
    char* data;
    size_t len;
  };
  Space space(int src);  // receiving(src) and not parked
  void received(int src, size_t n);

  // src closed its connection or broke it: fails its message in the middle and the receives that
  // wait for it (`why` follows its name), and every later receive from it that finds nothing kept.
  void source_gone(int src, const std::string& why);
  bool gone(int src) const { return in_[size_t(src)].gone; }

  // A receive whose wait gave up: out of the posted list, and the rest of a message it was taking
  // is dropped.
  void withdraw(const MailOpPtr& op);
  void fail(const MailOpPtr& op, const std::string& why);
  void drop_posted() { posted_.clear(); }  // shutdown: the mailbox fails every operation itself

  size_t posted_count() const { return posted_.size(); }
  size_t kept_count() const { return kept_.size(); }

 private:
  struct Arrival {  // the message arriving from one source
    bool active = false;   // header seen, payload not all in
    int64_t tag = 0;
    size_t nbytes = 0, got = 0;
    MailOpPtr cur;            // the receive it goes to (null: kept or dropped)
    std::vector<char> spill;  // kept: what has arrived so far
    bool keep = false;        // kept (else dropped: its receive withdrew, or the sizes differ)
    bool parked = false;
    bool gone = false;
    std::string gone_why;
  };
  struct Kept {
    int src;
    int64_t tag;
    std::vector<char> data;
  };
  std::deque<MailOpPtr>::iterator posted_for(int src, int64_t tag);
  MailOpPtr take_posted(int src, int64_t tag);
  void deliver(const MailOpPtr& op, int src, const char* data, size_t n);
  void adopt(Arrival& a, int src);
  void complete(Arrival& a, int src);
  void unpark(int src);

  int world_;
  MatchEvents& ev_;
  std::deque<MailOpPtr> posted_;  // receives no message has matched yet, oldest first
  std::deque<Kept> kept_;         // messages no receive has taken yet, in arrival order
  std::vector<Arrival> in_;       // by source rank
  std::vector<char> drain_;       // where the bytes of a dropped message go
};

}  // namespace sdp
