"""A job's flight recorder as the kernel reads it (docs/failures.md): the part of `Job` that asks the
analyser (sdp_jupyter/flight.py) about one job directory.

`JobFlight(job_dir, env)` follows the ranks' flight files and arrivals with one FlightLog, so a live
job's `hang` and `straggler` cost the lines written since the last question; `hang()` analyses at most
once a second. `request_rings` asks a live job's ranks to write their rings now; `analyse` gives the
Finding `Job.flight()` returns; `explained` ends a failed job's error with the recorder's sentence.
`sdp_jupyter.flight` is imported when first needed, so making or importing a Job loads no analyser.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from sdp_jupyter import jobdir


LOCATE_EVERY = 15.0  # seconds between two requests for the stacks of the ranks a hang waits for


def hang_warn_s(env: dict | None) -> float | None:
    """A job's SDP_HANG_WARN_S from its spec's environment (None: what the ranks' flight lines say they use)."""
    try:
        value = (env or {}).get("SDP_HANG_WARN_S")
        return float(value) if value else None
    except (TypeError, ValueError):
        return None


class JobFlight:
    """The flight recorder of the job in `job_dir` (`env`: its spec's environment, for SDP_HANG_WARN_S)."""

    def __init__(self, job_dir: str | Path, env: dict | None = None):
        self.dir = Path(job_dir)
        self.warn_s = hang_warn_s(env)
        self._lock = threading.Lock()
        self._log = None         # sdp_jupyter.flight.FlightLog, made when first asked
        self._hang_cache = None  # (monotonic time, sentence, awaited ranks) of the last analysis
        self._located: dict[int, str] = {}  # where each awaited rank is, from its stack (hang)
        self._located_at, self._locating = -LOCATE_EVERY, False  # when its stacks were last asked; asking now

    def log(self):
        """The ranks' flight files and arrivals, followed (sdp_jupyter.flight.FlightLog; with the lock held)."""
        if self._log is None:
            from sdp_jupyter import flight

            self._log = flight.FlightLog(self.dir, arrivals=True, window=100_000)
        return self._log

    def hang(self, run=None) -> str | None:
        """While the job runs: the analyser's live sentence, or None; one analysis a second at most, of
        the lines written since the last one. With `run` (the job's supervisor, which can ask for stacks:
        launch/kernel/agent_run/rank_requests.py), it ends saying where each rank the others wait for is, in its
        own code ("rank 3 is in stuck_in_data_loading() at script.py:5"), from that rank's stack, asked
        once and again every LOCATE_EVERY seconds while the wait lasts, aside (a status read never waits)."""
        from sdp_jupyter import flight

        now = time.monotonic()
        with self._lock:
            if self._hang_cache is None or now - self._hang_cache[0] >= 1.0:
                found = flight.live_finding(self.log(), self.warn_s)
                self._hang_cache = (now, found.sentence, found.awaited)
                if found.sentence is None:
                    self._located = {}  # the wait is over: where they were is no longer news
                elif found.awaited and hasattr(run, "request_stacks"):
                    self._locate(run, found.awaited, now)
            _, sentence, awaited = self._hang_cache
            where = [f"rank {r} is {self._located[r]}" for r in awaited if r in self._located]
            return "; ".join([sentence, *where]) if sentence and where else sentence

    def _locate(self, run, ranks: list[int], now: float) -> None:
        """Ask `ranks`' stacks in a thread of its own, unless asked less than LOCATE_EVERY s ago (the lock held)."""
        if self._locating or now - self._located_at < LOCATE_EVERY:
            return
        self._locating, self._located_at = True, now

        def ask():
            from sdp_jupyter.launch.kernel import stacks

            try:
                found = stacks.gather(run, self.dir, ranks)
                located = {r: found.where(r) for r, st in found.ranks.items() if st.error is None}
            except Exception:  # noqa: BLE001 - the job ended meanwhile: the sentence goes on without it
                located = {}
            with self._lock:
                self._located.update(located)
                self._locating = False

        threading.Thread(target=ask, daemon=True, name=f"sdp-locate-{self.dir.name}").start()

    def straggler(self, final: bool) -> str | None:
        """The stragglers analysis's sentence (`final`: the job has ended); None when no rank stands out."""
        from sdp_jupyter import flight

        try:
            with self._lock:
                return flight.job_stragglers(self.log(), final=final).sentence
        except Exception:  # noqa: BLE001 - a summary must never fail on a half-written file
            return None

    def request_rings(self, world_size: int, request=None, wait: float = 3.0) -> None:
        """Ask a live job's ranks to write their rings (the job goes on) and wait up to `wait` seconds
        until `world_size` flight files have grown. `request`: the run's request_flight, for remote
        ranks, whose agents touch their copy of the request file."""
        before = {p: p.stat().st_size for p in jobdir.flight_paths(self.dir)}
        jobdir.write_private(jobdir.flight_request_path(self.dir), str(time.time()))
        if request is not None:
            request()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = {p: p.stat().st_size for p in jobdir.flight_paths(self.dir)}
            grown = [p for p, size in now.items() if size > before.get(p, 0)]
            if len(grown) >= world_size:
                break
            time.sleep(0.1)

    def analyse(self, first_failure: dict | None, live: bool):
        """The analyser's Finding over what the ranks wrote (`live`: the job still runs)."""
        from sdp_jupyter import flight

        return flight.analyse(self.dir, first_failure=first_failure, warn_s=self.warn_s,
                              now=time.time() if live else None, live=live)

    def explained(self, error: str, first_failure: dict | None) -> str:
        """A failed job's error, ending with the flight recorder's sentence on the cause when it found
        one. `first_failure`: the first rank that ended (the exit codes of the others are the launcher
        stopping them)."""
        from sdp_jupyter import flight

        found = flight.cause_finding(self.dir, first_failure)
        why = found.sentence
        with self._lock:  # where the ranks the others waited for were, when last asked (hang)
            why = "; ".join([why] + [f"rank {r} was {self._located[r]}" for r in found.awaited if r in self._located]) \
                if why else why
        if why and why not in error:
            return f"{error}\nflight recorder: {why}"
        return error
