// The flight recorder's ring (see flight.h).
#include "sdp/flight.h"

#include <algorithm>
#include <chrono>

namespace sdp {

double wall_s() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

FlightEntry* FlightRing::at(uint64_t seq) {
  if (ring_.empty() || seq == 0) return nullptr;
  FlightEntry& e = ring_[seq % ring_.size()];
  return e.seq == seq ? &e : nullptr;  // overwritten by a newer one: nothing to update
}

void FlightRing::posted(const Work& w) {
  if (ring_.empty()) return;
  FlightEntry& e = ring_[w.id % ring_.size()];
  e.seq = w.id;
  e.count = w.count;
  e.root = w.root;
  e.coll = uint8_t(w.coll);
  e.dtype = uint8_t(w.dtype);
  e.op = uint8_t(w.op);
  e.state = FlightState::POSTED;
  e.posted = wall_s();
  e.started = e.ended = 0;
  newest_ = std::max(newest_, w.id);
}

void FlightRing::started(uint64_t seq) {
  if (FlightEntry* e = at(seq)) {
    e->state = FlightState::STARTED;
    e->started = wall_s();
  }
}

void FlightRing::ended(uint64_t seq, FlightState how) {
  if (FlightEntry* e = at(seq)) {
    e->state = how;
    e->ended = wall_s();
  }
}

std::vector<FlightEntry> FlightRing::snapshot(size_t last) const {
  std::vector<FlightEntry> out;
  if (ring_.empty() || newest_ == 0) return out;
  uint64_t n = std::min<uint64_t>(newest_, ring_.size());
  if (last) n = std::min<uint64_t>(n, last);
  out.reserve(size_t(n));
  for (uint64_t s = newest_ - n + 1; s <= newest_; ++s) {
    const FlightEntry& e = ring_[s % ring_.size()];
    if (e.seq == s) out.push_back(e);
  }
  return out;
}

}  // namespace sdp
