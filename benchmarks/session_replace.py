"""A session's rank SIGKILLed at random moments, many rounds: does the session come back whole, and how
fast, against what a user did before (stop the session, start a new one, run the setup cell again)?

    PYTHONPATH=. python benchmarks/session_replace.py [--ranks 4] [--rounds 20] [--any-rank] [--stop 0.3]
                                                     [--out results/session_replace.json]

One local smddp session (`session.start(JobSpec(code="pass", nodes=N))`). Each round a random rank
other than 0 (with --any-rank: rank 0 too) is SIGKILLed from outside (with --stop P: SIGSTOPped instead,
with probability P; the launcher kills a rank stopped for SDP_STOPPED_RANK_S, 2 s here, and replaces it): in most rounds at a random moment while a cell runs a loop of
4 KiB all_reduces (so the kill lands inside a collective, between two, or in Python), in one round of
five while the session is idle between cells. Then one check cell runs on every rank: an all_reduce
over all N ranks, the survivors' variable from the setup cell still there, `sdp_replaced` true on the
new rank only. "back in" is from the kill until the failing cell returned with the rank replaced (for
an idle kill: until the next cell returned); a round whose check fails, or that raises, is counted.

The peer, in the same run: `stop()` the session, `start` a new one and run the setup cell again: what
a dead rank cost before ranks were replaced (every rank's variables lost, not one rank's).
Not a test: nothing is asserted.
"""
from __future__ import annotations

import faulthandler
import os
import random
import signal
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _spawn import bench_parser, machine_info, write_results  # noqa: E402

SETUP = "import os, time, torch, torch.distributed as dist\nkept = dist.get_rank()\nt = torch.ones(1024)\n"
LOOP = "import time, torch.distributed as dist\nfor _ in range(4000):\n    dist.all_reduce(t)\n    time.sleep(0.0005)\n"
CHECK = ("import torch, torch.distributed as dist\nt = torch.ones(1024)\ndist.all_reduce(t)\n"
         "(t[0].item(), globals().get('kept'), sdp_replaced)")


def _pctl(values: list, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--restarts", type=int, default=3, help="rounds of the peer (stop + start + setup)")
    p.add_argument("--any-rank", action="store_true", help="rank 0 may be the victim too")
    p.add_argument("--stop", type=float, default=0.0, help="the chance that a round SIGSTOPs instead of SIGKILLs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "session_replace.json"))
    args = p.parse_args()
    from sdp_jupyter.launch import JobSpec
    from sdp_jupyter.launch.kernel import session as sessions

    faulthandler.dump_traceback_later(600, exit=True)  # a round that hangs ends the run with the stacks
    rng = random.Random(args.seed)
    n = args.ranks
    s = sessions.Session.start(JobSpec(code="pass", nodes=n, env={"SDP_STOPPED_RANK_S": "2"}))
    s.run(SETUP)
    rows, back, bad = [], [], 0
    try:
        for i in range(args.rounds):
            victim, idle = rng.randrange(0 if args.any_rank else 1, n), i % 5 == 4
            sig = signal.SIGSTOP if rng.random() < args.stop else signal.SIGKILL
            pid = s.ready[victim]["pid"]
            if idle:
                time.sleep(rng.uniform(0.0, 0.5))
                killed = time.monotonic()
                os.kill(pid, sig)
                first = s.run(CHECK, want="gather")
            else:
                delay = rng.uniform(0.05, 1.0)
                when = {}

                def kill(pid=pid, when=when, sig=sig):
                    when["t"] = time.monotonic()
                    os.kill(pid, sig)

                timer = threading.Timer(delay, kill)
                timer.start()
                first = s.run(LOOP)
                timer.join()
                killed = when["t"]
            seconds = time.monotonic() - killed
            check = s.run(CHECK, want="gather")
            values = [check.value(r) for r in range(n)] if not check.failed else []
            ok = (victim in first.failed and not check.failed
                  and all(v[0] == float(n) for v in values)
                  and [v[1] for v in values] == [None if r == victim else r for r in range(n)]
                  and [v[2] for v in values] == [r == victim for r in range(n)])
            if ok:
                back.append(seconds)
            else:
                bad += 1
                print(f"round {i}: not whole: first {first.message()[:400]!r} check {check.message()[:400]!r}")
            s.run("kept = dist.get_rank()\nsdp_replaced = False")  # the next round checks afresh
            rows.append({"round": i, "rank": victim, "signal": sig.name, "idle": idle, "back_s": round(seconds, 3),
                         "ok": ok})
            print(f"round {i:3d}: rank {victim} {sig.name} {'idle' if idle else 'in a cell'}: back in {seconds:.2f} s"
                  f"{'' if ok else '  NOT WHOLE'}", flush=True)
    finally:
        s.stop()
    fresh = []
    for _ in range(args.restarts):
        t0 = time.monotonic()
        s.stop()
        s = sessions.Session.start(JobSpec(code="pass", nodes=n))
        s.run(SETUP)
        fresh.append(time.monotonic() - t0)
    s.stop()
    print(f"\n{'':38s} {'rounds':>6s} {'whole':>6s} {'p50 s':>7s} {'p90 s':>7s} {'max s':>7s}")
    print(f"{'rank replaced in place':38s} {args.rounds:6d} {args.rounds - bad:6d} {_pctl(back, .5):7.2f} "
          f"{_pctl(back, .9):7.2f} {max(back, default=float('nan')):7.2f}")
    print(f"{'peer: stop + new session + setup cell':38s} {args.restarts:6d} {'-':>6s} {_pctl(fresh, .5):7.2f} "
          f"{_pctl(fresh, .9):7.2f} {max(fresh):7.2f}")
    ratio = statistics.median(fresh) / statistics.median(back) if back else float("nan")
    print(f"\nback to {n} ranks {ratio:.1f}x sooner than a new session, and only the dead rank's variables lost")
    faulthandler.cancel_dump_traceback_later()
    write_results(args.out, machine_info(), rows, ranks=n, any_rank=args.any_rank, stop=args.stop,
                  whole=args.rounds - bad,
                  replaced_p50_s=_pctl(back, .5), replaced_max_s=max(back, default=None),
                  fresh_session_p50_s=_pctl(fresh, .5), ratio=ratio)


if __name__ == "__main__":
    main()
