// Shared vocabulary of the engine: element types, reduction ops, errors, clocks.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace sdp {

enum class DType : uint8_t { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5, U8 = 6, I8 = 7 };
enum class ReduceOp : uint8_t { SUM = 0, AVG = 1, MAX = 2, MIN = 3, PRODUCT = 4 };
// What a collective is; travels in every frame header so that ranks calling different
// collectives are caught before anything is reduced. What each one is, takes and does: its record
// (coll_records.h).
// ALLGATHER and REDUCE_SCATTER work in place on world_size blocks of `count` elements each:
// block r belongs to rank r (all_gather: rank r's input is block r; reduce_scatter: rank r's
// result lands in block r). GATHER copies every rank's `buf` (count elements) to the root's block
// r = `blocks[r]` (one node only); SCATTER copies the root's `blocks[r]` to rank r's `buf`, for
// the ranks of the root's node (every rank submits it; on other nodes it returns at once). ALLTOALL
// sends block r of every rank's `src` to block `rank` of rank r's `buf` (world_size blocks of count
// elements on every rank) for every r on the same node as `rank`. Across nodes the caller moves
// the other blocks.
// A collective's code, as every frame header carries it. The codes and everything else about each
// collective are its record's (coll_records.cpp): no name here.
enum class Coll : uint8_t {};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(ReduceOp op);
bool valid_dtype(int t);
bool valid_op(int op);

// Names the calling thread ("sdp-progress", ...; at most 15 characters) so that a crash report,
// gdb, py-spy or top -H says which of the engine's threads it was.
void name_this_thread(const char* name);

// Every failure the engine reports to Python. The message is complete and names ranks.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& m) : std::runtime_error(m) {}
};

inline double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void log_warning(const std::string& msg);

// Waiting on a socket: with spinning on (SDP_SPIN > 0), a wait for a transfer of up to
// kSpinMaxBytes polls without sleeping for up to kSpinSeconds after the last event, yielding the
// core in between, then sleeps in poll(). A wake-up from poll() costs tens of microseconds on a
// busy host, which is most of a small message's time; a larger transfer sleeps at once (its
// wake-ups are small against it, and a polling thread would take a core its sender needs).
constexpr size_t kSpinMaxBytes = 256 << 10;
constexpr double kSpinSeconds = 200e-6;

// That policy for one wait: poll with timeout 0 (yielding the core after an empty poll) while
// spinning(), sleep in poll() after; progress() after every event restarts the window.
class SpinWindow {
 public:
  explicit SpinWindow(bool on) : on_(on), until_(on ? now_s() + kSpinSeconds : 0) {}
  bool spinning() const { return on_ && now_s() < until_; }
  void progress() {
    if (on_) until_ = now_s() + kSpinSeconds;
  }

 private:
  bool on_;
  double until_;
};

// An integer setting from the environment: `def` when unset or empty; anything but a whole
// decimal number within [lo, hi] throws an Error naming the variable (no atoi: garbage is refused).
long long env_int(const char* name, long long def, long long lo, long long hi);
// A boolean setting, with sdp_jupyter/_env.py's truth table: 1/true/yes/on and 0/false/no/off in
// any case; `def` when unset or empty; anything else throws an Error naming the variable.
bool env_bool(const char* name, bool def);

}  // namespace sdp
