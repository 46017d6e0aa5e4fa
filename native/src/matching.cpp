// The mailbox's matching rules: see matching.h.
#include "sdp/matching.h"

#include <algorithm>
#include <cstring>

namespace sdp {

std::string tag_text(int64_t tag) { return "tag " + std::to_string(tag); }

Matcher::Matcher(int world_size, MatchEvents& events)
    : world_(world_size), ev_(events), in_(size_t(world_size)), drain_(1 << 16) {}

void Matcher::post(const MailOpPtr& op) {
  int src = op->peer;
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    if ((src == -1 || it->src == src) && it->tag == op->tag) {
      Kept m = std::move(*it);
      kept_.erase(it);
      deliver(op, m.src, m.data.data(), m.data.size());
      return;
    }
  }
  if (src >= 0 && in_[size_t(src)].gone) {
    fail(op, ev_.who(src) + " " + in_[size_t(src)].gone_why);
    return;
  }
  posted_.push_back(op);
  // A parked message from this source is read again: straight into this receive if it fits, else
  // kept as before (this receive may wait for a message behind it on the same connection).
  if (src >= 0) {
    unpark(src);  // one flag on the common path, not a loop over the group
  } else {
    for (int r = 0; r < world_; ++r) unpark(r);
  }
}

void Matcher::unpark(int src) {
  Arrival& a = in_[size_t(src)];
  if (!a.parked) return;
  a.parked = false;
  ev_.resume(src);
}

void Matcher::deliver_whole(int src, int64_t tag, const char* data, size_t n) {
  if (auto r = take_posted(src, tag)) {
    deliver(r, src, data, n);
    return;
  }
  kept_.push_back({src, tag, std::vector<char>(data, data + n)});
}

void Matcher::deliver(const MailOpPtr& op, int src, const char* data, size_t n) {
  // A whole message for a receive (data null: the sizes differ, it only fails).
  if (n != op->nbytes) {
    fail(op, "recv of " + std::to_string(op->nbytes) + " bytes got a message of " + std::to_string(n) + " bytes from " +
                 ev_.who(src) + " (" + tag_text(op->tag) + "): the two sides disagree on the size");
    return;
  }
  if (n) std::memcpy(op->data, data, n);
  op->source = src;
  op->finished = true;
  ev_.finished();
}

std::deque<MailOpPtr>::iterator Matcher::posted_for(int src, int64_t tag) {
  return std::find_if(posted_.begin(), posted_.end(),
                      [&](const MailOpPtr& r) { return (r->peer == -1 || r->peer == src) && r->tag == tag; });
}

MailOpPtr Matcher::take_posted(int src, int64_t tag) {
  auto it = posted_for(src, tag);
  if (it == posted_.end()) return nullptr;
  auto op = *it;
  posted_.erase(it);
  return op;
}

void Matcher::begin(int src, int64_t tag, size_t nbytes) {
  Arrival& a = in_[size_t(src)];
  a.active = true;
  a.tag = tag;
  a.nbytes = nbytes;
  a.got = 0;
  a.keep = false;
  a.cur = take_posted(src, tag);
  bool mismatch = a.cur && a.cur->nbytes != nbytes;
  if (mismatch) {  // the receive fails naming both sizes; the message is consumed
    auto op = a.cur;
    a.cur.reset();
    deliver(op, src, nullptr, nbytes);
  }
  if (!a.cur) {
    a.keep = !mismatch;
    a.spill.clear();
    if (a.keep) a.spill.reserve(nbytes);  // address space only, filled as it arrives
    bool waited_for =
        std::any_of(posted_.begin(), posted_.end(), [&](const MailOpPtr& r) { return r->peer == -1 || r->peer == src; });
    if (a.keep && nbytes > kParkMinBytes && !waited_for) {
      // Nobody waits for this rank: its message stays in the socket until a receive is posted
      // (post resumes it), as gloo's sends wait for their receives.
      a.parked = true;
      return;
    }
  }
  if (nbytes == 0) complete(a, src);
}

// A receive posted while message `a` arrives unmatched takes it: what has arrived is copied over
// and the rest goes straight into the receive's buffer (a 64 MiB message no longer lands in a
// fresh buffer first and is copied again). The oldest receive that fits, as at the header; if its
// size differs it is left to fail, naming both sizes, when the message completes.
void Matcher::adopt(Arrival& a, int src) {
  auto it = posted_for(src, a.tag);
  if (it == posted_.end() || (*it)->nbytes != a.nbytes) return;
  a.cur = *it;
  posted_.erase(it);
  if (a.got) std::memcpy(a.cur->data, a.spill.data(), a.got);
  std::vector<char>().swap(a.spill);
  a.keep = false;
}

Matcher::Space Matcher::space(int src) {
  Arrival& a = in_[size_t(src)];
  if (!a.cur && a.keep) adopt(a, src);
  if (a.cur) return {a.cur->data + a.got, a.nbytes - a.got};
  if (a.keep) {  // kept a piece at a time, so a receive posted meanwhile takes the rest
    size_t upto = std::min(a.nbytes, a.got + kSpillStep);
    if (a.spill.size() < upto) a.spill.resize(upto);
    return {a.spill.data() + a.got, upto - a.got};
  }
  // dropped (its receive withdrew, or the sizes differ)
  return {drain_.data(), std::min(a.nbytes - a.got, drain_.size())};
}

void Matcher::received(int src, size_t n) {
  Arrival& a = in_[size_t(src)];
  a.got += n;
  if (a.got == a.nbytes) complete(a, src);
}

void Matcher::complete(Arrival& a, int src) {
  if (a.cur) {
    a.cur->source = src;
    a.cur->finished = true;
    a.cur.reset();
    ev_.finished();
  } else if (a.keep) {
    // A receive may have been posted while this message was arriving: it takes it now.
    if (auto op = take_posted(src, a.tag)) {
      deliver(op, src, a.spill.data(), a.spill.size());
    } else {
      kept_.push_back({src, a.tag, std::move(a.spill)});
    }
    a.spill.clear();
  }
  a.active = false;
  a.got = 0;
  a.keep = false;
}

void Matcher::source_gone(int src, const std::string& why) {
  Arrival& a = in_[size_t(src)];
  a.gone = true;
  a.gone_why = why;
  if (a.cur) fail(a.cur, ev_.who(src) + " " + why + " in the middle of a message");
  a.cur.reset();
  a.active = a.parked = a.keep = false;
  std::vector<char>().swap(a.spill);
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == src) {
      fail(*it, ev_.who(src) + " " + why);
      it = posted_.erase(it);
    } else {
      ++it;
    }
  }
}

void Matcher::withdraw(const MailOpPtr& op) {
  auto it = std::find(posted_.begin(), posted_.end(), op);
  if (it != posted_.end()) posted_.erase(it);
  for (auto& a : in_) {
    if (a.cur == op) {  // half received: the rest of the message is dropped
      a.cur.reset();
      a.keep = false;
      a.spill.clear();
    }
  }
}

void Matcher::fail(const MailOpPtr& op, const std::string& why) {
  if (op->finished) return;
  op->error = why;
  op->finished = true;
  ev_.finished();
}

}  // namespace sdp
