// A crash that names itself: on SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT, the thread's name
// ("sdp-progress", "MainThread"...) and its native frames go to stderr (the rank's log), then the
// handler that was there before (Python's faulthandler, which prints every thread's Python stack)
// runs and the process dies of the same signal. Engine frames show as _engine...so(+offset):
// `addr2line -e <the .so> -f -C <offset>` names them (the object exports no symbols).
#pragma once

namespace sdp {

// Installs the handlers once; later calls do nothing. Call it after faulthandler.enable().
void install_crash_report();

}  // namespace sdp
