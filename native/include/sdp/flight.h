// The flight recorder: every engine keeps the last N collectives it was asked for (PyTorch's
// FlightRecorder and Horovod's stall inspector are the models). Each entry says what the
// collective was, where it got to (posted, started, finished, failed, skipped because the group
// was already broken) and when. The engine writes it under the lock it already holds for its
// queue, so recording costs a few stores and three clock reads per collective (benchmarks/allreduce_ab.py
// against the build before the recorder: no cost measurable, docs/benchmarks.md section 16; SDP_FLIGHT_ENTRIES=0
// turns it off). Python reads it to dump a rank's ring into the job
// directory after a failure or on request, and to say while a job looks hung who waits where
// (sdp_jupyter/comm/recorder.py); a torch-free analyser turns the ranks' rings into one sentence
// (sdp_jupyter/flight.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sdp/frame.h"

namespace sdp {

enum class FlightState : uint8_t { POSTED = 0, STARTED = 1, FINISHED = 2, FAILED = 3, SKIPPED = 4 };

struct FlightEntry {
  uint64_t seq = 0;  // the collective's number on this group (its handle: "#seq" in every message)
  uint64_t count = 0;
  int32_t root = 0;
  uint8_t coll = 0, dtype = 0, op = 0;
  FlightState state = FlightState::POSTED;
  double posted = 0, started = 0, ended = 0;  // wall-clock seconds (comparable across hosts), 0: not yet
};

// Not thread-safe: the engine calls it with its queue lock held.
class FlightRing {
 public:
  explicit FlightRing(size_t capacity) : ring_(capacity) {}
  void posted(const Work& w);
  void started(uint64_t seq);
  void ended(uint64_t seq, FlightState how);
  // The newest `last` entries (all kept when 0), oldest first.
  std::vector<FlightEntry> snapshot(size_t last = 0) const;

 private:
  FlightEntry* at(uint64_t seq);
  std::vector<FlightEntry> ring_;
  uint64_t newest_ = 0;  // highest seq recorded
};

double wall_s();

}  // namespace sdp
