#include "sdp/common.h"

#include <pthread.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include <cstdio>

namespace sdp {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F64: case DType::I64: return 8;
    case DType::F16: case DType::BF16: return 2;
    case DType::U8: case DType::I8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"};
  auto i = static_cast<unsigned>(t);
  return i < 8 ? names[i] : "invalid-dtype";
}

const char* op_name(ReduceOp op) {
  static const char* names[] = {"SUM", "AVG", "MAX", "MIN", "PRODUCT"};
  auto i = static_cast<unsigned>(op);
  return i < 5 ? names[i] : "invalid-op";
}

bool valid_dtype(int t) { return t >= 0 && t <= 7; }
bool valid_op(int op) { return op >= 0 && op <= 4; }

void log_warning(const std::string& msg) {
  std::fprintf(stderr, "[smddp] warning: %s\n", msg.c_str());
  std::fflush(stderr);
}

long long env_int(const char* name, long long def, long long lo, long long hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return def;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != 0 || x < lo || x > hi)
    throw Error(std::string(name) + "=" + v + " is not a whole number between " + std::to_string(lo) + " and " +
                std::to_string(hi));
  return x;
}

bool env_bool(const char* name, bool def) {
  const char* v = std::getenv(name);
  std::string s;
  for (const char* c = v ? v : ""; *c; ++c) s += char(std::tolower(static_cast<unsigned char>(*c)));
  size_t a = s.find_first_not_of(" \t\n\r\f\v"), b = s.find_last_not_of(" \t\n\r\f\v");
  if (a == std::string::npos) return def;
  s = s.substr(a, b - a + 1);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw Error(std::string(name) + "=" + v + " is not a boolean: use one of 1/0, true/false, yes/no, on/off");
}

void name_this_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace sdp
