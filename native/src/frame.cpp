#include "sdp/frame.h"

#include <utility>

#include "sdp/coll_records.h"

namespace sdp {

namespace {
bool reduces(int c) {
  const CollRecord* r = find_coll(c);
  return r && r->reduces;
}
bool rooted(int c) {
  const CollRecord* r = find_coll(c);
  return r && r->rooted;
}
}  // namespace

std::string describe(const Work& w, uint64_t seq) {
  if (w.count == 0) return std::string(coll_name(int(w.coll))) + " #" + std::to_string(seq);  // no data: a barrier
  std::string d = std::string(coll_name(int(w.coll))) + " #" + std::to_string(seq) + " (" + std::to_string(w.count) + " x " +
                  dtype_name(w.dtype);
  if (reduces(int(w.coll))) d += std::string(", ") + op_name(w.op);
  else if (rooted(int(w.coll))) d += ", root " + std::to_string(w.root);
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
  if (a.coll != b.coll) return set("collective", coll_name(a.coll), coll_name(b.coll));
  if (a.count != b.count) return set("element count", std::to_string(a.count), std::to_string(b.count));
  if (a.dtype != b.dtype) return set("dtype", dtype_name(DType(a.dtype)), dtype_name(DType(b.dtype)));
  if (reduces(a.coll) && a.op != b.op) return set("reduce op", op_name(ReduceOp(a.op)), op_name(ReduceOp(b.op)));
  if (rooted(a.coll) && a.root != b.root)
    return set("root", std::to_string(a.root), std::to_string(b.root));
  return false;
}

}  // namespace sdp
