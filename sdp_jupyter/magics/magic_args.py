"""What every sdp_jupyter magic shares: the option table as magic arguments, POSIX parsing of a
magic's line, and the one message for a syntax error in a cell."""
from __future__ import annotations

import shlex

from IPython.core import magic_arguments
from IPython.core.error import UsageError

from sdp_jupyter.launch.spec import all_options


def with_options(func):
    """Add every row of the option table to a magic (so `%%sdp_train?` shows them all)."""
    for opt in reversed(all_options()):
        func = magic_arguments.argument(opt.flag, **opt.argparse_kwargs())(func)
    func = magic_arguments.magic_arguments()(func)
    # magic_arguments writes the usage as a line magic ("%sdp_train"); this one is a cell magic
    func.parser.prog = f"%%{func.__name__}"
    func.__doc__ = func.__doc__.replace(f"%{func.__name__} [", f"%%{func.__name__} [", 1)
    return func


def parse_line(magic_func, line: str):
    """Parse a magic's line with POSIX quoting (so --args "--lr 0.1" is one value, without quotes)."""
    try:
        argv = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"cannot parse the options ({e}): check the quotes") from None
    return magic_func.parser.parse_args(argv)


def usage(message: str) -> UsageError:
    return UsageError(f"{message}\nNothing was launched. See %%sdp_train? for the options.")


def syntax_error_message(e: SyntaxError) -> str:
    """The one message for a syntax error in a cell magic's code (%%sdp_train, %%sdp_cell, %%sdp_px):
    the line is numbered as the notebook shows the cell, whose line 1 is the %%magic line (so the
    code's line N is the cell's line N + 1), then the line itself and the fix."""
    line = (e.lineno or 1) + 1
    where = f"\n    {e.text.rstrip()}" if e.text else ""
    return (f"syntax error on line {line} of the cell: {e.msg}{where}\n"
            "Fix that line (the ranks run plain Python: no %magics or !commands)")
