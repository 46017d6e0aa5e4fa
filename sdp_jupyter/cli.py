"""`sdp-train`: the local launcher without a notebook, for terminals and CI.

    sdp-train --nodes 4 --backend gloo train.py --epochs 3

Options are the same as %%sdp_train's (one option table, sdp_jupyter.launch.spec.all_options()), except the
notebook-only --wait (the CLI always waits), --push and --result. Rank 0's output (or every rank's,
with --ranks-output all) streams to stdout. Exit status: 0 when the job succeeded, 1 when it failed,
2 on bad options (nothing launched), 130 when stopped with Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys

from sdp_jupyter.launch import JobSpec, SpecError, launch
from sdp_jupyter.launch.spec import all_options

NOTEBOOK_ONLY = ("--wait", "--push", "--result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdp-train", description="Run a training script as a distributed job on this machine.")
    for opt in all_options():
        if opt.flag not in NOTEBOOK_ONLY:
            parser.add_argument(opt.flag, **opt.argparse_kwargs())
    parser.add_argument("script", help="the training script (.py), run as __main__ on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    try:
        spec = JobSpec.from_options(values, script=ns.script)
        if ns.script_args:
            spec = spec.replace(args=list(spec.args) + list(ns.script_args))
        job = launch(spec)
    except SpecError as e:
        parser.error(f"{e} (nothing was launched)")
    print(f"sdp-train: job {job.name} in {job.dir}", file=sys.stderr)
    try:
        job.follow()
    except KeyboardInterrupt:
        job.stop()
        print(f"sdp-train: {job.summary()}", file=sys.stderr)
        return 130
    print(f"sdp-train: {job.summary()}", file=sys.stderr)
    return 0 if job.state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
