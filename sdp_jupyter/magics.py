"""%%sdp_train and friends. Load with `%load_ext sdp_jupyter`.

The magics only parse, validate and hand a JobSpec to sdp_jupyter.launch; the Job they return is a
view over the job (a live widget in a notebook, text in a terminal). Bad input raises a UsageError
naming the option and the fix, and launches nothing."""
from __future__ import annotations

import shlex
import sys
import time

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import display

import sdp_jupyter.launch as launching
from sdp_jupyter.launch import Job, JobError, JobSpec, SpecError
from sdp_jupyter.launch.host import warm
from sdp_jupyter.launch.kernel import warm_pool
from sdp_jupyter.launch.spec import all_options
from sdp_jupyter._display import widgets_enabled


def _with_options(func):
    """Add every row of the option table to a magic (so `%%sdp_train?` shows them all)."""
    for opt in reversed(all_options()):
        func = magic_arguments.argument(opt.flag, **opt.argparse_kwargs())(func)
    func = magic_arguments.magic_arguments()(func)
    # magic_arguments writes the usage as a line magic ("%sdp_train"); this one is a cell magic
    func.parser.prog = f"%%{func.__name__}"
    func.__doc__ = func.__doc__.replace(f"%{func.__name__} [", f"%%{func.__name__} [", 1)
    return func


def _with_setup_options(func):
    """%sdp_setup's options (one per JobSetup keyword; sdp_jupyter.jobsetup.setup_arguments)."""
    from sdp_jupyter.jobsetup import setup_arguments

    for flags, kw in reversed(setup_arguments()):
        func = magic_arguments.argument(*flags, **kw)(func)
    return magic_arguments.magic_arguments()(func)


def parse_line(magic_func, line: str):
    """Parse a magic's line with POSIX quoting (so --args "--lr 0.1" is one value, without quotes)."""
    try:
        argv = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"cannot parse the options ({e}): check the quotes") from None
    return magic_func.parser.parse_args(argv)


def _usage(message: str) -> UsageError:
    return UsageError(f"{message}\nNothing was launched. See %%sdp_train? for the options.")


def syntax_error_message(e: SyntaxError) -> str:
    """The one message for a syntax error in a cell magic's code (%%sdp_train, %%sdp_cell, %%sdp_px):
    the line is numbered as the notebook shows the cell, whose line 1 is the %%magic line (so the
    code's line N is the cell's line N + 1), then the line itself and the fix."""
    line = (e.lineno or 1) + 1
    where = f"\n    {e.text.rstrip()}" if e.text else ""
    return (f"syntax error on line {line} of the cell: {e.msg}{where}\n"
            "Fix that line (the ranks run plain Python: no %magics or !commands)")


def check_cell(cell: str) -> None:
    """Reject an empty cell or a syntax error (reported with the cell's own line number)."""
    if not cell.strip():
        raise _usage("the cell is empty: write the training code below the %%sdp_train line")
    try:
        compile(cell, "<sdp_train cell>", "exec")
    except SyntaxError as e:
        raise _usage(syntax_error_message(e)) from None


class _JobTable:
    """%sdp_jobs output: HTML in a notebook, text elsewhere."""

    COLUMNS = ("name", "state", "elapsed", "ranks", "backend", "restarts", "where", "directory", "why")

    def __init__(self, jobs: list[Job], mine: set):
        self.rows = [(j.name, j.state, f"{j.elapsed:.1f} s", f"{j.spec.nodes}x{j.spec.procs_per_node or 1}",
                      j.spec.backend, str(j.restarts), "this kernel" if j.dir in mine else "disk", str(j.dir),
                      self._why(j)) for j in jobs]

    @staticmethod
    def _why(job: Job) -> str:
        """The flight recorder's sentence: who waits where (running), or what failed (failed)."""
        st = job.status
        if st.get("hang"):
            return "waiting: " + st["hang"]
        for line in str(st.get("error") or "").splitlines():
            if line.startswith("flight recorder: "):
                return line[len("flight recorder: "):]
        return ""

    def __repr__(self) -> str:
        if not self.rows:
            return "no jobs (none launched in this kernel, none under the jobs directory)"
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) for i, c in enumerate(self.COLUMNS)]
        lines = ["  ".join(c.ljust(wd) for c, wd in zip(self.COLUMNS, widths))]
        lines += ["  ".join(v.ljust(wd) for v, wd in zip(row, widths)) for row in self.rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        if not self.rows:
            return f"<i>{html.escape(repr(self))}</i>"
        head = "".join(f"<th>{c}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"


class _CellStream:
    """A %%sdp_px cell's output as it comes: every rank's lines, prefixed "[rank R] " when there are
    several ranks; what arrives just after the last answer is waited for briefly (QUIET seconds)."""

    QUIET = 0.03

    def __init__(self, job: Job):
        import queue

        self.job = job
        self.lines: queue.Queue = queue.Queue()
        self.prefix = job.world_size > 1
        self.last = time.monotonic()
        job.subscribe(self._heard)

    def _heard(self, rank: int, text: str) -> None:
        self.last = time.monotonic()
        self.lines.put(f"[rank {rank}] {text}" if self.prefix else text)

    def drain(self) -> None:
        wrote = False
        while not self.lines.empty():
            sys.stdout.write(self.lines.get())
            wrote = True
        if wrote:
            sys.stdout.flush()

    def close(self) -> None:
        deadline = time.monotonic() + 0.5
        while time.monotonic() - self.last < self.QUIET and time.monotonic() < deadline:
            time.sleep(0.005)
        self.job.unsubscribe(self._heard)
        self.drain()


class _SessionStatus:
    """%sdp_session status: text (and the same table in HTML)."""

    def __init__(self, status: dict):
        self.status = status

    def __repr__(self) -> str:
        from sdp_jupyter.launch.kernel.session import describe

        return describe(self.status)


@magics_class
class SdpMagics(Magics):
    @_with_options
    @cell_magic
    def sdp_train(self, line: str, cell: str):
        """Run this cell's code as the training script of a distributed job (one process per rank).

        Without --wait the cell returns at once with the Job (a live view with a Stop button).
        The cell's last expression on rank 0 is the job's result (--result NAME stores it here).
        """
        try:
            args = parse_line(self.sdp_train, line)
        except UsageError as e:
            raise _usage(str(e)) from None
        check_cell(cell)
        ns = self.shell.user_ns
        try:
            spec = JobSpec.from_options(vars(args), code=cell)
            push = {n: ns[n] for n in spec.push if n in ns}
            job = launching.launch(spec, push=push)
        except SpecError as e:
            raise _usage(str(e)) from None
        if not args.wait:
            if spec.result:
                job.on_done(lambda j: self._store_result(j, spec.result, quiet=True))
            return job
        self._wait_streaming(job)
        if spec.result:
            self._store_result(job, spec.result)
        return None

    def _wait_streaming(self, job: Job) -> None:
        """Block until the job ends, showing its output; Ctrl-C stops it; raise if it failed."""
        widget = widgets_enabled()
        if widget:
            display(job.view())
        try:
            if widget:
                job.wait()
            else:
                job.follow()
        except KeyboardInterrupt:
            job.stop()
            print(job.summary())
            raise JobError(f"job {job.name} was stopped (Ctrl-C); its logs are in {job.dir / 'logs'}", job) from None
        print(job.summary())
        job.raise_for_state()

    def _store_result(self, job: Job, name: str, quiet: bool = False) -> None:
        if job.state != "succeeded":
            return
        try:
            self.shell.user_ns[name] = job.result()
        except JobError as e:
            if not quiet:
                raise
            print(f"sdp_jupyter: --result {name}: {e}")
        except Exception as e:  # unpickling needs a module the notebook lacks, ...
            message = f"--result {name}: rank 0's result could not be loaded here ({type(e).__name__}: {e})"
            if not quiet:
                raise JobError(message, job) from None
            print(f"sdp_jupyter: {message}")

    # ------------------------------------------------------------------ line magics
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("root", nargs="?", default=None,
                              help="the jobs directory to list (default: $SDP_JOBS_DIR, else ./sdp_jobs)")
    @line_magic
    def sdp_jobs(self, line: str = ""):
        """Table of this kernel's jobs and the jobs found under the jobs directory."""
        args = parse_line(self.sdp_jobs, line)
        mine = {j.dir for j in launching.jobs()}
        display(_JobTable(launching.list_jobs(args.root), mine))

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", nargs="?", help="job name (default: every running job of this kernel)")
    @line_magic
    def sdp_stop(self, line: str = ""):
        """Stop a job (SIGINT, SIGTERM, then SIGKILL to every rank)."""
        args = parse_line(self.sdp_stop, line)
        if args.name:
            targets = [self._job(args.name)]
        else:
            targets = [j for j in launching.jobs() if not j.done]
            if not targets:
                print("no running job in this kernel")
                return
        for job in targets:
            try:
                job.stop()
            except JobError as e:
                raise UsageError(str(e)) from None
            print(f"job {job.name}: {job.state}")

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", help="job name")
    @magic_arguments.argument("--rank", type=int, default=0, help="global rank (default 0)")
    @magic_arguments.argument("--tail", type=int, default=None, help="only the last N lines")
    @line_magic
    def sdp_logs(self, line: str = ""):
        """Print one rank's log."""
        args = parse_line(self.sdp_logs, line)
        job = self._job(args.name)
        try:
            sys.stdout.write(job.logs(args.rank, tail=args.tail))
        except JobError as e:
            raise UsageError(str(e)) from None

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", nargs="?", help="job name (default: the latest job of this kernel)")
    @magic_arguments.argument("--last", type=int, default=8, help="operations per rank in the table (default 8)")
    @line_magic
    def sdp_flight(self, line: str = ""):
        """The flight recorder of a job: a running job's ranks write their rings (the job goes on); the
        cause in one sentence, then the last operations per rank aligned by sequence number, the first
        disagreement marked (docs/failures.md)."""
        args = parse_line(self.sdp_flight, line)
        job = self._job(args.name)
        found = job.flight()
        found.last = args.last
        straggler = job.straggler
        if straggler:
            print(f"straggler: {straggler}")
        return found  # shown as the sentence and the table (HTML in a notebook, text in a terminal)

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", nargs="?", help="job name (default: the latest job of this kernel)")
    @line_magic
    def sdp_wait(self, line: str = ""):
        """Block until a job ends; raise if it failed."""
        args = parse_line(self.sdp_wait, line)
        job = self._job(args.name)
        try:
            job.wait()
        except KeyboardInterrupt:
            print(f"stopped waiting; job {job.name} is still {job.state} (%sdp_stop {job.name} stops it)")
            return
        print(job.summary())
        job.raise_for_state()
        if job.spec.result:
            self._store_result(job, job.spec.result)

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("modules", nargs="*",
                              help="modules the pool imports too, e.g. numpy sklearn (or numpy,sklearn)")
    @line_magic
    def sdp_warm(self, line: str = ""):
        """Start this kernel's warm pool now and wait until it is ready: the next %%sdp_train jobs fork
        their ranks from it instead of starting fresh interpreters (docs/warm.md). The pool imports torch,
        torch.optim, torch.distributed, torch.nn.parallel, torch.fx's symbolic shapes, sdp_jupyter.torch and the modules
        named here. Without it the pool starts after the kernel's first job. This is the local target's
        pool; an SSH host gets its own from a job run with --warm or after the kernel's first job there, a
        Ray node only from a job run with --warm."""
        args = parse_line(self.sdp_warm, line)
        modules = [m.strip() for arg in args.modules for m in arg.split(",") if m.strip()]
        try:
            JobSpec(code="pass", preload=modules)  # the same check as --preload
        except SpecError as e:
            raise UsageError(str(e).replace("--preload", "%sdp_warm")) from None
        started = time.monotonic()
        pool = warm_pool.warm_up(modules)
        reason = pool.ready()
        if reason:
            print(f"warm pool not usable ({reason}): %%sdp_train jobs start cold")
            return
        imported = ", ".join(list(warm.BASE_MODULES) + pool.preload)
        print(f"warm pool ready in {time.monotonic() - started:.1f} s (pid {pool.proc.pid}, imported {imported})")
        for failure in pool.info.get("preload_failed") or []:
            print(f"  could not import {failure}")
        if not warm_pool.wanted(None):
            print("SDP_WARM=0 is set: jobs still start cold unless given --warm")
        else:
            print("the next %%sdp_train jobs of this kernel start warm (--cold: fresh interpreters)")

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--no-smoke", action="store_true", help="skip the 2-rank all_reduce runs")
    @line_magic
    def sdp_doctor(self, line: str = ""):
        """Will it work on this machine? The report of `python -m sdp_jupyter.doctor` (run in a fresh
        process: the kernel never imports torch), one line per check with the fix for anything not OK."""
        from sdp_jupyter.doctor import report_in_subprocess

        args = parse_line(self.sdp_doctor, line)
        print(report_in_subprocess(smoke=not args.no_smoke).text())

    @line_magic
    @_with_setup_options
    def sdp_setup(self, line: str = ""):
        """Show the job setup form (sdp_jupyter.JobSetup), preset from these options.

        Choose target, instance type and count and hyperparameters; the form shows the scaling hints
        and the %%sdp_train line of the same job, and its Launch button starts it.
        """
        from sdp_jupyter.jobsetup import setup_from_options

        args = parse_line(self.sdp_setup, line)
        try:
            return setup_from_options(vars(args))
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{e}\nSee %sdp_setup? for the options.") from None

    @cell_magic
    def sdp_cell(self, line: str, cell: str):
        """%%sdp_cell NAME: keep this cell's code under NAME without running it, as the training code
        of `sdp_jupyter.JobSetup(cell=NAME)` or `%sdp_setup --cell NAME`."""
        from sdp_jupyter.jobsetup import store_cell

        try:
            print(store_cell(line.strip(), cell))
        except ValueError as e:
            raise UsageError(str(e)) from None
        except SyntaxError as e:
            raise UsageError(syntax_error_message(e)) from None

    # ------------------------------------------------------------------ interactive sessions
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("action", choices=("start", "stop", "status", "shrink"),
                              help="start ranks that keep their process group and variables between cells; "
                                   "stop them; show them; go on without the ranks lost with their host")
    @line_magic
    def sdp_session(self, line: str = ""):
        """%sdp_session start [any %%sdp_train option: --nodes, --target, --procs-per-node, --backend,
        --hosts, --address, --env, --push ...] | stop | status | shrink

        A session's ranks run every %%sdp_px cell in a namespace each keeps until the session stops
        (docs/session.md). It ends with the kernel, like a job. When a host is gone for good, a cell's error
        says which ranks it took; `shrink` makes the process group again of the ranks left."""
        from sdp_jupyter.launch.kernel import session as sessions

        action, _, rest = line.strip().partition(" ")
        if action not in ("start", "stop", "status", "shrink"):
            raise UsageError("%sdp_session start [options] | stop | status | shrink (see %sdp_session?)")
        if action == "start":
            try:
                args = parse_line(self.sdp_train, rest)
            except UsageError as e:
                raise UsageError(f"{e}\nNo session was started. The options are %%sdp_train's.") from None
            ns = self.shell.user_ns
            started = time.monotonic()
            try:
                spec = JobSpec.from_options(vars(args), code="pass")
                live = sessions.start(spec, push={n: ns[n] for n in spec.push if n in ns})
            except SpecError as e:
                raise UsageError(f"{e}\nNo session was started.") from None
            if widgets_enabled():
                display(live.job.view())
            hosts = sorted(set(live.status()["hosts"].values()))
            print(f"session {live.job.name}: {live.job.world_size} ranks ready in {time.monotonic() - started:.1f} s "
                  f"({live.job.spec.backend}, on {', '.join(map(str, hosts))}); run cells with %%sdp_px")
            return None
        live = sessions.current()
        if live is None:
            print("no session is running in this kernel (%sdp_session start --nodes N starts one)")
            return None
        if action == "stop":
            print(f"session {live.job.name}: {live.stop()}")
            return None
        if action == "shrink":
            inside = [r for r in live.still_inside() if r not in live.stranded]
            if inside:  # interrupted now; inside a collective with a silent lost rank they leave it at its deadline
                print(f"rank(s) {', '.join(map(str, inside))} are still in the last cell: interrupted; a collective "
                      f"with a lost rank ends at the group's deadline (SDP_TIMEOUT, {live.group_timeout():g} s)")
            print("\n".join(live.shrink().notes))
            return None
        return _SessionStatus(live.status())

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--ranks", default=None,
                              help="run on these ranks only, e.g. 0,3; a collective among them takes group=sdp_group")
    @magic_arguments.argument("--result", default=None, metavar="NAME",
                              help="store the first rank's last expression here as NAME")
    @magic_arguments.argument("--gather", default=None, metavar="NAME",
                              help="store every rank's last expression here as the list NAME (by rank)")
    @magic_arguments.argument("--push", default="", metavar="NAMES",
                              help="send these notebook variables to every rank first, e.g. lr,config")
    @cell_magic
    def sdp_px(self, line: str, cell: str):
        """Run this cell on every rank of this kernel's session (%sdp_session start), in the namespace
        each rank keeps between cells. An exception on any rank fails the cell and names the rank; the
        session stays up. Ctrl-C interrupts the cell on every rank."""
        from sdp_jupyter.launch.kernel import session as sessions

        args = parse_line(self.sdp_px, line)
        if args.result and args.gather:
            raise UsageError("--result and --gather both name where the value goes: use one")
        try:
            compile(cell, "<sdp_px cell>", "exec")
        except SyntaxError as e:
            raise UsageError(syntax_error_message(e)) from None
        live = sessions.current()
        if live is None:
            raise UsageError("no session is running in this kernel. Fix: %sdp_session start --nodes 4 "
                             "(then %%sdp_px runs cells on its ranks)")
        try:
            ranks = [int(r) for r in args.ranks.replace(" ", "").split(",") if r] if args.ranks else None
        except ValueError:
            raise UsageError(f"--ranks {args.ranks!r}: give rank numbers separated by commas, e.g. --ranks 0,3") from None
        names = [n for n in args.push.replace(" ", "").split(",") if n]
        want = "gather" if args.gather else "result" if args.result else "none"
        stream = _CellStream(live.job)
        try:
            result = live.run(cell, ranks=ranks, want=want, push_names=names, values=self.shell.user_ns,
                              on_wait=stream.drain, label=f"In[{self.shell.execution_count}]")
        except SpecError as e:
            stream.close()
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:
            stream.close()
            last = live.last
            raise sessions.SessionError(last.message() if last is not None and last.failed else
                                        "cell interrupted; the session is still up", live.job) from None
        except sessions.SessionError:
            stream.close()
            raise
        stream.close()
        if result.failed:
            raise sessions.SessionError(result.message(), live.job)
        if args.gather:
            self.shell.user_ns[args.gather] = [result.value(r) if r in result.ranks else None
                                               for r in range(live.job.world_size)]
        elif args.result:
            self.shell.user_ns[args.result] = result.value(result.ranks[0])
        return None

    def _job(self, name: str | None) -> Job:
        try:
            return launching.get_job(name)
        except JobError as e:
            raise UsageError(str(e)) from None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(SdpMagics)


def unload_ipython_extension(ipython) -> None:
    pass
