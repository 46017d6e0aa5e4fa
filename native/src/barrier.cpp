// barrier: every rank returns once every rank has called it. One byte of the engine's own is
// all-reduced under the barrier's description, so a rank in a barrier and a rank in an all_reduce
// are a mismatch that names both, and the flight recorder says "barrier".
#include <cstdint>

#include "sdp/collectives.h"

namespace sdp {

void Collectives::barrier(const Work& w) {
  uint8_t token = 0;
  Work t = w;
  t.buf = reinterpret_cast<char*>(&token);
  t.count = 1;
  t.dtype = DType::U8;
  t.op = ReduceOp::MAX;
  all_reduce(t);
}

}  // namespace sdp
