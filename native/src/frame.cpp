#include "sdp/frame.h"

#include <utility>

namespace sdp {

static bool has_root(Coll c) { return c == Coll::BROADCAST || c == Coll::GATHER || c == Coll::SCATTER; }

std::string describe(const Work& w, uint64_t seq) {
  std::string d = std::string(coll_name(w.coll)) + " #" + std::to_string(seq) + " (" + std::to_string(w.count) + " x " +
                  dtype_name(w.dtype);
  if (w.coll == Coll::ALLREDUCE || w.coll == Coll::REDUCE_SCATTER) d += std::string(", ") + op_name(w.op);
  else if (has_root(w.coll)) d += ", root " + std::to_string(w.root);
  return d + ")";
}

bool first_difference(const Described& a, const Described& b, std::string* field, std::string* va, std::string* vb) {
  auto set = [&](const char* f, std::string x, std::string y) {
    *field = f;
    *va = std::move(x);
    *vb = std::move(y);
    return true;
  };
  if (a.seq != b.seq) return set("collective number", std::to_string(a.seq), std::to_string(b.seq));
  if (a.coll != b.coll) return set("collective", coll_name(Coll(a.coll)), coll_name(Coll(b.coll)));
  if (a.count != b.count) return set("element count", std::to_string(a.count), std::to_string(b.count));
  if (a.dtype != b.dtype) return set("dtype", dtype_name(DType(a.dtype)), dtype_name(DType(b.dtype)));
  if ((a.coll == uint8_t(Coll::ALLREDUCE) || a.coll == uint8_t(Coll::REDUCE_SCATTER)) && a.op != b.op)
    return set("reduce op", op_name(ReduceOp(a.op)), op_name(ReduceOp(b.op)));
  if (has_root(Coll(a.coll)) && a.root != b.root)
    return set("root", std::to_string(a.root), std::to_string(b.root));
  return false;
}

}  // namespace sdp
