"""`sdp-train`: the launcher without a notebook, for terminals and CI (every target of
launch/targets/__init__.py: local, ssh, ray, slurm, sagemaker).

    sdp-train --nodes 4 --backend gloo train.py --epochs 3

Options are the same as %%sdp_train's (one option table, sdp_jupyter.launch.spec.all_options()), except the
notebook-only --wait (the CLI always waits), --push and --result. A bare --shard-optimizer or
--checkpoint-activations right before the script means its default level (optimizer, layer). Rank 0's
output (or every rank's, with --ranks-output all) streams to stdout. Exit status: 0 when the job
succeeded, 1 when it failed, 2 on bad options (nothing launched), 130 when stopped with Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from sdp_jupyter.launch import JobSpec, SpecError, launch, targets
from sdp_jupyter.launch.spec import all_options

NOTEBOOK_ONLY = ("--wait", "--push", "--no-auto-push", "--result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdp-train", description="Run a training script as a distributed job on a target (--target): "
                                       f"{targets.listed()}. The default, local, is this machine.")
    for opt in all_options():
        if opt.flag not in NOTEBOOK_ONLY:
            parser.add_argument(opt.flag, **opt.argparse_kwargs())
    parser.add_argument("script", help="the training script (.py), run as __main__ on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def spell_out_levels(argv: list[str]) -> list[str]:
    """Give a bare optional-value flag its level (`--shard-optimizer train.py` ->
    `--shard-optimizer=optimizer train.py`): argparse would otherwise take the script for the level.
    Only the options before the script are looked at; a level is a plain word that is not a file."""
    options = {o.flag: o for o in all_options()}
    out, i = list(argv), 0
    while i < len(out):
        token = out[i]
        if token == "--" or not token.startswith("-"):
            break  # the script: what follows is the script's own arguments
        opt = options.get(token)
        if opt is not None and opt.kind == "optional":
            following = out[i + 1] if i + 1 < len(out) else ""
            if not re.fullmatch(r"[A-Za-z_]+", following) or os.path.isfile(following):
                out[i] = f"{token}={opt.const}"
            else:
                i += 1
        elif opt is not None and opt.kind != "flag":
            i += 1  # its value
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(spell_out_levels(sys.argv[1:] if argv is None else argv))
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
