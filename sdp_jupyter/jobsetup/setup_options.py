"""`%sdp_setup`'s options: the fields of a JobSetup (sdp_jupyter/jobsetup/model.py) as command-line options.

One option per field: each ``scaling.Plan`` field with its meaning (``FIELD_HELP``), its choices
(``FIELD_CHOICES``, the lists Plan itself checks against) and its default (from Plan), plus the script,
``--cell``, ``--name`` and the fields each target adds to the form (its record's ``form``: the option
as %%sdp_train spells it, e.g. ``--hosts``, ``--partition``). ``setup_arguments()`` gives
them as argparse rows; the magic (magics.py) and ``jobsetup.setup_from_line`` both build their parsers
from it.
"""
from __future__ import annotations

import argparse
from dataclasses import fields as dc_fields

from sdp_jupyter import backends, instances, scaling
from sdp_jupyter.launch import targets

#: %sdp_setup's meaning of each Plan field (the form's fields; the choices and defaults come from the code)
FIELD_HELP = {
    "target": "where the job runs",
    "instance_type": "SageMaker instance type (--target sagemaker; other targets run on the machines they have, "
                     "shown as local)",
    "nodes": "number of nodes (instances, hosts)",
    "procs_per_node": "worker processes per node, one per GPU on GPU hosts, as %%sdp_train's --procs-per-node (on "
                      "SageMaker: the instance type's GPU count, whatever is given)",
    "backend": "torch.distributed backend",
    "mode": "when scaling: keep_per_gpu keeps each GPU's batch (the global batch and the LR grow), "
            "keep_global keeps the global batch at --reference-batch (each GPU gets a share)",
    "per_gpu_batch": "samples per GPU per step (used by keep_per_gpu)",
    "reference_lr": "the learning rate the model was tuned at",
    "reference_batch": "the global batch --reference-lr was tuned at (also the global batch keep_global keeps)",
    "rule": "how the LR follows k = global batch / reference batch: linear multiplies it by k (Goyal et al. "
            "2017), sqrt by the square root of k, none leaves it",
    "warmup_epochs": "epochs of linear LR warm-up (default: suggested, up to 5 epochs when the LR was raised)",
    "epochs": "epochs to train",
    "dataset_size": "samples per epoch, for the steps per epoch and the time estimate",
    "optimizer": "the optimizer the script uses (lars and lamb tolerate very large global batches)",
    "batchnorm": "whether the model uses BatchNorm (small per-GPU batches then get a warning)",
    "drop_last": "whether the partial last batch of an epoch is dropped, as DistributedSampler's drop_last",
    "throughput_per_gpu": "samples/s on one GPU, measured, for the time and cost estimate (default: none, "
                          "no estimate)",
    "scaling_efficiency": "fraction of linear speed-up assumed on more than one GPU, in (0, 1]",
    "price_per_hour": "USD per node-hour for the cost estimate (default: the catalogue's, often unknown)",
    "engine": "--target sagemaker: who provides --backend smddp: sdp is sdp_jupyter's engine, aws SageMaker's "
              "smdistributed library, auto SageMaker's on the types it supports and ours elsewhere",
}

#: Plan fields with a fixed set of values: the lists Plan itself checks against
FIELD_CHOICES = {"target": scaling.TARGETS, "backend": backends.BACKENDS, "mode": scaling.MODES,
                 "rule": scaling.RULES, "optimizer": scaling.OPTIMIZERS, "engine": instances.ENGINES}


def setup_arguments() -> list[tuple[tuple, dict]]:
    """`%sdp_setup`'s options as (flags, argparse keywords): one per JobSetup keyword
    (``--per-gpu-batch 64``), plus the script, ``--cell``, and the targets' form fields as %%sdp_train
    spells their options (``--hosts``, ``--address``, ``--partition``, ...). The magic (magics.py, built with magic_arguments) and `setup_from_line` both take
    them from here. Every Plan field has its meaning in FIELD_HELP; its choices and default come from
    scaling.Plan and FIELD_CHOICES."""
    rows: list[tuple[tuple, dict]] = [
        (("script",), {"nargs": "?", "help": "training script (.py); or use --cell NAME"}),
        (("--cell",), {"help": "a cell stored with %%%%sdp_cell NAME"}),  # argparse %-formats help: shows %%sdp_cell
        (("--name",), {"help": "job name"}),
    ]
    for f in dc_fields(scaling.Plan):
        if f.name == "cpus":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = "none" if f.default is None else "yes" if f.default is True else "no" if f.default is False \
            else f.default
        meaning = FIELD_HELP[f.name]  # KeyError: a new Plan field needs its meaning here
        kw: dict = {"dest": f.name, "help": (meaning if "(default" in meaning else f"{meaning} (default {default})")}
        if f.name in ("batchnorm", "drop_last"):
            kw["choices"] = ("yes", "no")
        elif f.name in FIELD_CHOICES:
            kw["choices"] = FIELD_CHOICES[f.name]
        elif f.name == "instance_type":
            kw["choices"] = tuple(instances.names())
        elif f.type in ("int", int):
            kw["type"] = int
        elif "float" in str(f.type):
            kw["type"] = float
        kw["help"] = kw["help"].replace("%", "%%")
        rows.append(((flag,), kw))
    # the old name of --procs-per-node, kept working (jobsetup.setup_from_options warns) and left out of the help
    rows.append((("--gpus-per-node",), {"dest": "gpus_per_node", "type": int, "help": argparse.SUPPRESS}))
    for _target, field in targets.form_fields():  # each target's fields, as its options spell them
        opt = field.option
        rows.append(((opt.flag,), {"dest": field.name, "metavar": opt.metavar, "help": opt.help.replace("%", "%%")}))
    return rows
