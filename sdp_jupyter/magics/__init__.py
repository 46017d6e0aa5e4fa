"""The notebook's magics, registered by `%load_ext sdp_jupyter` (load_ipython_extension): %%sdp_train and
the job magics (%sdp_jobs, %sdp_stop, %sdp_logs, ..., %sdp_setup, %%sdp_cell: job_magics.py), a session's
(%sdp_session, %%sdp_px, %sdp_debug: session_magics.py), and what every magic shares: the option table as
magic arguments, POSIX parsing of a line, the syntax-error message (magic_args.py).
"""
from sdp_jupyter.magics.job_magics import SdpMagics, load_ipython_extension, magic_classes, unload_ipython_extension
from sdp_jupyter.magics.magic_args import parse_line
from sdp_jupyter.magics.session_magics import SessionMagics

__all__ = ["SdpMagics", "SessionMagics", "load_ipython_extension", "magic_classes", "parse_line",
           "unload_ipython_extension"]
