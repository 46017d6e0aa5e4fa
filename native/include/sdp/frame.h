// What travels between ranks and what a collective is: the frame header every TCP message
// starts with, the queued collective, and how two ranks' descriptions of one collective are
// compared (the frame-header check and the shared-memory check use the same comparison).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sdp/common.h"

namespace sdp {

constexpr uint32_t kFrameMagic = 0x46504453;  // "SDPF"

enum class FrameType : uint8_t { DATA = 1, ERROR = 2, BYE = 3 };

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t type;
  uint8_t coll;
  uint8_t dtype;
  uint8_t op;
  uint32_t src_rank;  // global rank of the sender
  uint32_t root;      // broadcast root (0 otherwise)
  uint64_t seq;       // collective sequence number on this process group
  uint64_t count;     // total elements of the collective
  uint64_t offset;    // first element of this payload within the collective
  uint64_t nbytes;    // payload bytes that follow
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 48, "frame header layout");

// One queued collective on the user's buffer.
struct Work {
  uint64_t id;
  Coll coll;
  char* buf;
  size_t count;
  DType dtype;
  ReduceOp op;
  int root;
  const char* src;            // ALLTOALL: the input (see Coll); null for the in-place collectives
  std::vector<char*> blocks;  // GATHER, SCATTER on the root: one buffer per rank (see Coll)
};

// "all_reduce #12 (1000 x float32, SUM)": how messages name a collective. Only for errors
// (OpState::desc() calls it when one is raised), never on a collective's success path.
std::string describe(const Work& w, uint64_t seq);

// What two ranks said about the collective they are running.
struct Described {
  uint64_t seq, count;
  uint32_t root;
  uint8_t coll, dtype, op;
};

// The first field in which a and b differ, with both values in words; false if they agree.
bool first_difference(const Described& a, const Described& b, std::string* field, std::string* va, std::string* vb);

// Shard k of n elements split N ways is [n*k/N, n*(k+1)/N): any n, shards differ by at most one.
inline size_t shard_lo(size_t n, int k, int N) { return n * size_t(k) / size_t(N); }

// That shard as its first element and its element count.
struct Shard {
  size_t lo, count;
};
inline Shard shard(size_t n, int k, int N) { return {shard_lo(n, k, N), shard_lo(n, k + 1, N) - shard_lo(n, k, N)}; }

}  // namespace sdp
