"""%sdp_session and %%sdp_px: the magics of an interactive session, a thin face on
sdp_jupyter.launch.kernel.session.Session (registered with the others by `%load_ext sdp_jupyter`)."""
from __future__ import annotations

import time

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import display

from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.kernel.session_calls import CellStream
from sdp_jupyter.magics.magic_args import parse_line, syntax_error_message, with_options
from sdp_jupyter._display import widgets_enabled


def with_notebook_code(spec: JobSpec, cell: str, ns: dict) -> JobSpec:
    """`spec` with the notebook functions and classes `cell` uses added to its --push (said in one line,
    the job's first): a rank has no notebook, so without them the cell fails there with a NameError."""
    from sdp_jupyter.launch.kernel.push import auto_push_line, notebook_code

    names = notebook_code(cell, ns, spec.push)
    if not names:
        return spec
    print(auto_push_line(names))
    return spec.replace(push=list(spec.push) + names)


@with_options
def sdp_train(line: str, cell: str):
    """%sdp_train [options]: what `%sdp_session start` takes (the option table, as %%sdp_train's)."""


_start_options = sdp_train


class _SessionStatus:
    """%sdp_session status: text (and the same table in HTML)."""

    def __init__(self, status: dict):
        self.status = status

    def __repr__(self) -> str:
        from sdp_jupyter.launch.kernel.session import describe

        return describe(self.status)


@magics_class
class SessionMagics(Magics):
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
                args = parse_line(_start_options, rest)
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
        stream = CellStream(live.job)
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
        stream.close(result)
        if result.failed:
            raise sessions.SessionError(result.message(), live.job)
        if args.gather:
            self.shell.user_ns[args.gather] = [result.value(r) if r in result.ranks else None
                                               for r in range(live.job.world_size)]
        elif args.result:
            self.shell.user_ns[args.result] = result.value(result.ranks[0])
        return None

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("rank", type=int, help="the rank whose last failed cell pdb opens")
    @magic_arguments.argument("-c", dest="commands", action="append", default=None, metavar="CMD",
                              help="a pdb command, run in order (repeatable, as python -m pdb -c); pdb quits "
                                   "after the last. Without -c pdb reads each command from an input box")
    @line_magic
    def sdp_debug(self, line: str = ""):
        """%sdp_debug RANK [-c CMD ...]: a post-mortem pdb on RANK's traceback of the last session cell
        that failed there, as %debug is for this kernel; the other ranks wait, and after `q` the session
        goes on with every rank's variables (docs/session.md). A breakpoint() in a %%sdp_px cell needs
        no magic: its pdb prompts in the cell's input box while the other ranks go on."""
        from sdp_jupyter.launch.kernel import session as sessions

        args = parse_line(self.sdp_debug, line)
        live = sessions.current()
        if live is None:
            raise UsageError("no session is running in this kernel, so there is no rank to debug. Fix: "
                             "%sdp_session start --nodes 2, then a %%sdp_px cell; %debug looks into this kernel")
        stream = CellStream(live.job)  # what the ranks print meanwhile (stderr, a warning) still shows
        try:
            out = live.debug(args.rank, args.commands, on_wait=stream.drain)
        except KeyboardInterrupt:
            out = "pdb ended (interrupted); the session is still up"
        finally:
            stream.close()
        if out:
            print(out.rstrip("\n"))
        return None
