#include "sdp/engine.h"

#include <algorithm>

#include "sdp/coll_records.h"
#include "sdp/reduce.h"

namespace sdp {

namespace {
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

Engine::Engine(EngineConfig cfg)
    : cfg_(std::move(cfg)), topo_(cfg_.rank, cfg_.node_of_rank), links_(topo_, *this), shm_(topo_, *this),
      colls_(topo_, *this, links_, shm_), conns_(topo_, *this, links_, shm_, cfg_.secret, cfg_.timeout_s),
      flight_(size_t(env_int("SDP_FLIGHT_ENTRIES", 2048, 0, 1 << 20))) {
  if (topo_.local_size() > kMaxLocal) throw Error("at most 256 ranks per node are supported");
  if (cfg_.chunk_bytes < 4096) cfg_.chunk_bytes = 4096;
  cfg_.chunk_bytes = round_up(cfg_.chunk_bytes, 64);
  timeout_s = cfg_.timeout_s;
  // Measured on 2 cores with 2 ranks training (docs/benchmarks.md): spinning, then yielding,
  // beat going to sleep early, even though the machine is oversubscribed: a sleeping rank
  // pays a wake-up and a trip through the run queue on every barrier (and on every frame
  // awaited over TCP: the links poll before they sleep too).
  shm_.configure(cfg_.chunk_bytes, cfg_.spin >= 0 ? cfg_.spin : 2000);
  links_.set_spin(cfg_.spin != 0);
  colls_.configure(cfg_.chunk_bytes, int(env_int("SDP_PIPELINE_DEPTH", 2, 1, 2)));
}

Engine::~Engine() {
  try { shutdown(); } catch (...) {}
}

std::pair<int, std::string> Engine::prepare(PortRange ports) {
  int port = conns_.prepare(cfg_.bind_addr, ports);
  return {port, shm_.name()};
}

void Engine::connect(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  conns_.connect(addrs, ports);
  colls_.start();
  connected_ = true;
  progress_ = std::thread([this] {
    name_this_thread("sdp-progress");
    progress_loop();
  });
}

uint64_t Engine::submit(Coll c, void* buf, size_t count, DType t, ReduceOp op, int root, const void* src,
                        std::vector<char*> blocks) {
  const CollRecord& r = coll_record(c);
  if (root < 0 || root >= world_size()) throw Error("root " + std::to_string(root) + " is not a rank of this group");
  if (r.span == Span::ONE_NODE && num_nodes() > 1)
    throw Error(std::string(r.name) + " runs in the engine only when every rank of the group is on one node "
                "(across nodes, send the blocks as messages)");
  if (r.needs_src && !src) throw Error(std::string(r.name) + " needs its input buffer");
  if (r.root_blocks && rank() == root && blocks.size() != size_t(world_size()))
    throw Error(std::string(r.name) + " on the root needs one buffer per rank");
  std::lock_guard<std::mutex> g(mu_);
  if (!connected_) throw Error("engine is not connected");
  if (stopping_) throw Error("the process group has been shut down");
  uint64_t id = next_id_++;
  queue_.push_back(Work{id, c, static_cast<char*>(buf), count, t, op, root, static_cast<const char*>(src), std::move(blocks)});
  flight_.posted(queue_.back());
  work_cv_.notify_one();
  return id;
}

void Engine::wait(uint64_t h, double wait_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto finished = [&] { return completed_ >= h || (failed_from_ && h >= failed_from_) || stopping_; };
  auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                       std::chrono::duration<double>(wait_s > 0 ? wait_s : 1e9));
  while (!finished()) {
    // The waiting thread runs queued work itself when the progress thread is not busy: a
    // blocking call then costs no thread hand-off (it matters for small collectives).
    if (!busy_ && !queue_.empty() && queue_.front().id <= h) {
      execute_front(lk);
      continue;
    }
    if (done_cv_.wait_until(lk, until) == std::cv_status::timeout && !finished())
      throw Error("timed out after " + fmt_seconds(wait_s) + " s waiting for collective handle " + std::to_string(h));
  }
  if (failed_from_ && h >= failed_from_) throw Error(broken_);
  if (completed_ < h) throw Error("the process group was shut down before this collective ran");
}

bool Engine::test(uint64_t h) {
  std::lock_guard<std::mutex> g(mu_);
  if (failed_from_ && h >= failed_from_) throw Error(broken_);
  return completed_ >= h;
}

std::string Engine::broken_message() {
  std::lock_guard<std::mutex> g(mu_);
  return broken_;
}

std::vector<FlightEntry> Engine::flight(size_t last) {
  std::lock_guard<std::mutex> g(mu_);
  return flight_.snapshot(last);
}

Stats Engine::stats() {
  std::lock_guard<std::mutex> g(mu_);
  Stats s = stats_;
  s.peer_read_bytes = colls_.peer_read_bytes();
  return s;
}

void Engine::execute_front(std::unique_lock<std::mutex>& lk) {
  // Called with mu_ held and busy_ false; runs the first queued collective with mu_ released.
  busy_ = true;
  Work w = queue_.front();
  bool already_broken = failed_from_ != 0;
  if (!already_broken) flight_.started(w.id);
  lk.unlock();
  // A failure is a flag, never "a non-empty message": an error whose text was lost (an empty
  // exception message, a peer's ERROR frame without a body) must still fail the collective.
  bool failed = false;
  std::string err;
  double t0 = now_s();
  if (!already_broken) {
    try {
      run(w);
    } catch (const Error& e) {
      failed = true;
      err = e.what();
    } catch (const std::exception& e) {
      failed = true;
      err = std::string("internal error: ") + e.what();
    } catch (...) {
      failed = true;
    }
  }
  lk.lock();
  busy_ = false;
  queue_.pop_front();
  if (failed && !failed_from_) {
    failed_from_ = w.id;
    broken_ = err.empty() ? "rank " + std::to_string(cfg_.rank) + ": " + desc() + " failed (its message was lost)" : err;
  }
  running = nullptr;
  flight_.ended(w.id, already_broken ? FlightState::SKIPPED : failed ? FlightState::FAILED : FlightState::FINISHED);
  if (!failed_from_) {
    completed_ = w.id;
    stats_.collectives++;
    stats_.bytes += w.count * dtype_size(w.dtype);
    stats_.busy_s += now_s() - t0;
  }
  done_cv_.notify_all();
  work_cv_.notify_all();
}

void Engine::progress_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!busy_ && !queue_.empty()) {
      execute_front(lk);
      continue;
    }
    if (stopping_ && queue_.empty()) return;
    work_cv_.wait_for(lk, std::chrono::milliseconds(20));
    if (busy_ || !queue_.empty() || stopping_ || failed_from_) continue;
    // Idle: notice dead ranks and error frames early, so the next call fails fast.
    busy_ = true;
    lk.unlock();
    bool failed = false;
    std::string err;
    try { idle_check(); } catch (const Error& e) { failed = true; err = e.what(); } catch (...) { failed = true; }
    lk.lock();
    busy_ = false;
    if (failed && !failed_from_) {
      // Every handle not completed yet fails, not only those submitted from now on: a collective
      // submitted while this check ran (mu_ released) is queued already; it would be skipped as
      // broken, never complete, and its waiter would sleep forever (the missed death of issue 40:
      // the progress thread idle, the caller waiting, about once in 100 runs under load).
      failed_from_ = completed_ + 1;
      broken_ = err.empty() ? "rank " + std::to_string(cfg_.rank) + " failed between collectives (its message was lost)" : err;
    }
    done_cv_.notify_all();
    work_cv_.notify_all();
  }
}

void Engine::run(const Work& w) {
  seq++;
  running = &w;
  deadline = now_s() + cfg_.timeout_s;
  if (world_size() == 1) return colls_.one_rank(w);
  (colls_.*coll_record(w.coll).run)(w);  // submit() checked the code
}

// ---------------------------------------------------------------- the first-error latch

void Engine::fail(const std::string& msg, bool remote) {
  std::string final_msg = shm_.active() ? shm_.latch_error(msg, &remote) : msg;
  if (final_msg.empty()) final_msg = "rank " + std::to_string(cfg_.rank) + " failed in " + desc() + " (its message was lost)";
  if (is_leader() && !remote) links_.send_error_frames(final_msg);
  throw Error(final_msg);
}

void Engine::report(const std::string& msg) {
  std::lock_guard<std::mutex> g(report_mu_);
  if (reported_.empty()) reported_ = msg.empty() ? "rank " + std::to_string(cfg_.rank) + " failed outside the engine" : msg;
  has_report_.store(true, std::memory_order_release);
  work_cv_.notify_all();
}

void Engine::check_health(const std::function<bool()>* settled) {
  std::string m;
  bool remote = false;
  if (has_report_.load(std::memory_order_acquire)) {
    {
      std::lock_guard<std::mutex> g(report_mu_);
      m = reported_;
    }
    fail(m);  // latched for this node, sent to the other nodes: the cause, not the cascade
  }
  if (shm_.published_error(&m, &remote)) {
    if (settled && (*settled)()) return;  // the next collective reports it
    if (is_leader() && !remote) links_.send_error_frames(m);
    throw Error(m);
  }
  conns_.check_local_ranks(settled);
}

void Engine::idle_check() {
  // Between collectives: notice dead ranks and error frames early, so the next call fails fast.
  // (running is null here, so an error says "while this rank was idle").
  check_health();
  if (is_leader()) links_.idle_check();
}

// ---------------------------------------------------------------- shutdown

void Engine::shutdown() {
  // One shutdown at a time: Python may call it from a process group's destroy and from the
  // engine's finalizer on another thread; two joins of one std::thread are undefined behaviour.
  std::lock_guard<std::mutex> once(shutdown_mu_);
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_ && !progress_.joinable() && !conns_.accepting()) return;
    // Let queued collectives finish (or fail) before stopping.
    double until = now_s() + std::min(cfg_.timeout_s, 30.0);
    while (!queue_.empty() && !failed_from_ && now_s() < until) done_cv_.wait_for(lk, std::chrono::milliseconds(50));
    stopping_ = true;
    conns_.stop_accepting();
    work_cv_.notify_all();
    done_cv_.notify_all();
  }
  if (progress_.joinable()) progress_.join();
  // A failure reported from outside (a message whose peer died) and not yet passed on: pass it on
  // before the connections close, or this rank's peers blame its exit instead of the cause.
  if (connected_ && has_report_.load() && !shm_published()) {
    try { check_health(); } catch (...) {}
  }
  conns_.close(now_s() + 1.0);
  if (is_leader()) shm_.unlink();  // set-up did not finish: the segment is still named
  shm_.unmap();
}

}  // namespace sdp
