"""%%sdp_train and friends. Load with `%load_ext sdp_jupyter`.

The magics only parse, validate and hand a JobSpec to sdp_jupyter.launch; the Job they return is a
view over the job (a live widget in a notebook, text in a terminal). Bad input raises a UsageError
naming the option and the fix, and launches nothing."""
from __future__ import annotations

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
from sdp_jupyter.launch.kernel.run_function import wait_shown
from sdp_jupyter.magics.magic_args import parse_line, syntax_error_message, usage as _usage, with_options
from sdp_jupyter.magics.session_magics import SessionMagics, with_notebook_code


def _with_setup_options(func):
    """%sdp_setup's options (one per JobSetup keyword; sdp_jupyter.jobsetup.setup_arguments)."""
    from sdp_jupyter.jobsetup import setup_arguments

    for flags, kw in reversed(setup_arguments()):
        func = magic_arguments.argument(*flags, **kw)(func)
    return magic_arguments.magic_arguments()(func)


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
        """The flight recorder's sentence: who waits where (running), or what failed (failed); else the
        failed ranks grouped by cause (`ranks 1-3 raised ValueError: boom; rank 0 lost a peer`)."""
        from sdp_jupyter.launch.kernel.rank_groups import describe

        st = job.status
        if st.get("hang"):
            return "waiting: " + st["hang"]
        for line in str(st.get("error") or "").splitlines():
            if line.startswith("flight recorder: "):
                return line[len("flight recorder: "):]
        return describe(st.get("failure_groups") or []) if st.get("state") == "failed" else ""

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


@magics_class
class SdpMagics(Magics):
    @with_options
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
            if not args.no_auto_push:
                spec = with_notebook_code(spec, cell, ns)
            push = {n: ns[n] for n in spec.push if n in ns}
            job = launching.launch(spec, push=push)
        except SpecError as e:
            raise _usage(str(e)) from None
        if not args.wait:
            if spec.result:
                job.on_done(lambda j: self._store_result(j, spec.result, quiet=True))
            return job
        wait_shown(job)
        if spec.result:
            self._store_result(job, spec.result)
        return None

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
    @magic_arguments.argument("name", nargs="?", help="job name (default: this kernel's session, else its latest job)")
    @magic_arguments.argument("--ranks", type=int, nargs="+", default=None, help="only these ranks (default: all)")
    @magic_arguments.argument("--wait", type=float, default=5.0, help="seconds to wait for the ranks (default 5)")
    @line_magic
    def sdp_stacks(self, line: str = ""):
        """Every rank's Python stack now, equal stacks grouped, each group with where it is (its innermost
        frame of your code, the collective it waits in): also inside a collective or C code, nothing
        attached to the ranks (docs/failures.md, "Where is every rank?")."""
        from sdp_jupyter.launch.kernel import session as sessions

        args = parse_line(self.sdp_stacks, line)
        live = sessions.current() if args.name is None else None
        job = live.job if live is not None else self._job(args.name)
        try:
            return job.stacks(args.ranks, wait=args.wait)
        except (JobError, ValueError) as e:
            raise UsageError(str(e)) from None

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

    def _job(self, name: str | None) -> Job:
        try:
            return launching.get_job(name)
        except JobError as e:
            raise UsageError(str(e)) from None


def magic_classes() -> list:
    """Every Magics class `%load_ext sdp_jupyter` registers (the reference page lists their magics)."""
    return [SdpMagics, SessionMagics]


def load_ipython_extension(ipython) -> None:
    for magics in magic_classes():
        ipython.register_magics(magics)


def unload_ipython_extension(ipython) -> None:
    pass
