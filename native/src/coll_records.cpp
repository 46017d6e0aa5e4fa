#include "sdp/coll_records.h"

#include <array>

namespace sdp {

const std::vector<CollRecord>& coll_records() {
  // {code, name, reduces, rooted, root_blocks, needs_src, span, alone, algorithm, doc}; a code is a
  // collective's for good (it travels in frame headers): a new one takes the next
  static const std::vector<CollRecord> records = {
      {Coll{1}, "all_reduce", true, false, false, false, Span::ALL, Alone::KEEP, &Collectives::all_reduce,
       "every rank's buffer <- the reduction of every rank's buffer"},
      {Coll{2}, "broadcast", false, true, false, false, Span::ALL, Alone::KEEP, &Collectives::broadcast,
       "every rank's buffer <- the root's"},
      {Coll{3}, "all_gather", false, false, false, false, Span::ALL, Alone::KEEP, &Collectives::all_gather,
       "in place on world_size blocks: block r <- rank r's block r"},
      {Coll{4}, "reduce_scatter", true, false, false, false, Span::ALL, Alone::KEEP, &Collectives::reduce_scatter,
       "in place on world_size blocks: rank r's block r <- the reduction of every rank's block r"},
      {Coll{5}, "gather", false, true, true, false, Span::ONE_NODE, Alone::BUF_TO_BLOCK, &Collectives::gather,
       "the root's block r <- rank r's buffer"},
      {Coll{6}, "scatter", false, true, true, false, Span::NODE_PART, Alone::BLOCK_TO_BUF, &Collectives::scatter,
       "rank r's buffer <- the root's block r"},
      {Coll{7}, "all_to_all", false, false, false, true, Span::NODE_PART, Alone::SRC_TO_BUF, &Collectives::all_to_all,
       "block r of the output <- block rank of rank r's input"},
      {Coll{8}, "barrier", false, false, false, false, Span::ALL, Alone::KEEP, &Collectives::barrier,
       "returns once every rank has called it; moves none of the caller's data"},
  };
  return records;
}

const CollRecord* find_coll(int c) {
  // By code, built once: two lookups per collective (submit's checks, the dispatch) cost an index.
  static const std::array<const CollRecord*, 256> by_code = [] {
    std::array<const CollRecord*, 256> a{};
    for (const CollRecord& r : coll_records()) a[size_t(r.code)] = &r;
    return a;
  }();
  return c >= 0 && c < 256 ? by_code[size_t(c)] : nullptr;
}

const CollRecord& coll_record(Coll c) {
  const CollRecord* r = find_coll(int(c));
  if (!r) throw Error("invalid collective code " + std::to_string(int(c)));
  return *r;
}

const char* coll_name(int c) {
  const CollRecord* r = find_coll(c);
  return r ? r->name : "invalid-collective";
}

const char* span_name(Span s) {
  switch (s) {
    case Span::ALL: return "all";
    case Span::ONE_NODE: return "one_node";
    case Span::NODE_PART: return "node_part";
  }
  return "invalid-span";
}

}  // namespace sdp
