#include "sdp/crash.h"

#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>

namespace sdp {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_previous[NSIG];
std::atomic<bool> g_installed{false};

// Only async-signal-safe calls from here on: write(2), prctl(2), backtrace (its first call,
// which may allocate, happened at install), sigaction(2), raise(3).
void put(const char* s) {
  ssize_t ignored = ::write(STDERR_FILENO, s, strlen(s));
  (void)ignored;
}

void on_fatal_signal(int sig, siginfo_t*, void*) {
  char name[17] = {0};
  prctl(PR_GET_NAME, name, 0, 0, 0);
  put("\n[sdp_jupyter] fatal signal ");
  char num[8];
  int n = sig, i = sizeof(num) - 1;
  num[i] = 0;
  do {
    num[--i] = char('0' + n % 10);
    n /= 10;
  } while (n && i > 0);
  put(num + i);
  put(" (");
  put(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : sig == SIGILL ? "SIGILL" : "SIGABRT");
  put(") in thread '");
  put(name);
  put("'; its native frames, innermost first:\n");
  void* frames[64];
  int got = backtrace(frames, 64);
  backtrace_symbols_fd(frames, got, STDERR_FILENO);
  // The previous handler (faulthandler: every thread's Python stack) gets the signal next: it is
  // blocked while this handler runs and delivered as soon as it returns.
  sigaction(sig, &g_previous[sig], nullptr);
  raise(sig);
}

}  // namespace

void install_crash_report() {
  if (g_installed.exchange(true)) return;
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside a signal handler
  for (int sig : kSignals) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_fatal_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, &g_previous[sig]);
  }
}

}  // namespace sdp
