// One record per collective: its name and code (the code travels in every frame header), what a
// call gives, what the engine covers in each layout, and its algorithm. Every "which collectives..."
// question reads these records: the engine's checks and dispatch (engine.cpp), a collective's
// description and the fields its ranks must agree on (frame.cpp), the binding, and through it
// Python's tables and routing (sdp_jupyter/comm/codes.py). Adding a collective: its algorithm (a
// Collectives method in its own .cpp, declared in collectives.h), its record in coll_records.cpp (its
// code is the record's), and the torch method (docs/architecture.md, "Adding a collective").
#pragma once
#include <cstdint>
#include <vector>

#include "sdp/collectives.h"
#include "sdp/common.h"

namespace sdp {

// What the engine moves, by layout of the group.
enum class Span : uint8_t {
  ALL = 0,        // every byte, whatever the layout
  ONE_NODE = 1,   // only when every rank is on one node; across nodes the caller sends messages instead
  NODE_PART = 2,  // the blocks between ranks of one node; the caller moves the other nodes' blocks as
                  // messages at the same time
};

// What a group of one rank does: nothing to move between ranks, only the caller's own copy.
enum class Alone : uint8_t {
  KEEP = 0,           // in place: the buffer already holds the answer
  BUF_TO_BLOCK = 1,   // the root's block 0 <- the buffer (gather)
  BLOCK_TO_BUF = 2,   // the buffer <- the root's block 0 (scatter)
  SRC_TO_BUF = 3,     // the buffer <- the separate input (all_to_all)
};

struct CollRecord {
  Coll code;
  const char* name;
  bool reduces;      // takes a reduce op, which its ranks must agree on
  bool rooted;       // has a root, which its ranks must agree on
  bool root_blocks;  // the root gives one buffer per rank (`blocks`)
  bool needs_src;    // reads a separate input buffer (`src`)
  Span span;
  Alone alone;       // in a group of one rank
  void (Collectives::*run)(const Work&);  // the algorithm (it picks its path by layout)
  const char* doc;                          // one line: what it does (the Python side's docstring)
};

// Every collective, in code order.
const std::vector<CollRecord>& coll_records();
// The record of code `c`, or nullptr when no collective has it.
const CollRecord* find_coll(int c);
// The record of a valid code.
const CollRecord& coll_record(Coll c);
const char* span_name(Span s);
// The name of code `c` ("invalid-collective" when none has it: a peer's garbled frame).
const char* coll_name(int c);

}  // namespace sdp
