"""`%%sdp_train --target sagemaker --rehearse`: a SageMaker job rehearsed on this machine, for free.

The rehearsal goes through the same path as a real submission (SageMakerLauncher.submit): the plan
and the draft request checked against botocore's service model, the same source directory built,
the SageMaker SDK's ModelTrainer building the final CreateTrainingJob request, which the request gate
validates again. Only the AWS it talks to differs: the local stand-in (testing/sagemaker_standin/: a moto
server on 127.0.0.1 and a thread that plays SageMaker). The stand-in runs the job as SageMaker would:
`--nodes` hosts as local process groups, each under SageMaker's own Torchrun driver and the
environment SageMaker's own environment.py computes (SM_HOSTS, SM_CURRENT_HOST, SM_CHANNEL_*), the
/opt/ml layout mapped under `<job dir>/rehearsal/`, the container entry from the built source
directory; each host's output goes into the local CloudWatch Logs and from there, as for a real job,
into the job view, the metrics and the dashboard; output.tar.gz brings the result back.

Before any host starts, a rehearsal also checks what SageMaker would only find out at run time:
every s3:// input channel must have local data (`--rehearse-data s3://bucket/prefix=./folder`),
every $SM_CHANNEL_<NAME> the script reads must be a channel of the job, and the script must compile.
"""
from __future__ import annotations

import re
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter import backends
from sdp_jupyter.launch.options import SpecError

REHEARSAL_DIR = jobdir.REHEARSAL  # in the job directory: the hosts' /opt/ml trees and the image's packages

#: What a rehearsal checks (shown in its summary).
CHECKED = (
    "the options and the CreateTrainingJob request against botocore's SageMaker service model "
    "(instance type, names, ranges, sizes)",
    "the source directory as uploaded (script, container entry, spec, pushed variables, sdp_jupyter)",
    "input channels: every s3:// channel has data, every $SM_CHANNEL_<NAME> the script reads exists",
    "the script on N hosts under SageMaker's Torchrun driver and environment (SM_HOSTS, SM_CURRENT_HOST, "
    "SM_CHANNEL_*, /opt/ml), with its logs, metrics, failure reason and result",
)
#: Checked as well when the job uses our engine (--engine sdp, or auto on a type AWS's library refuses).
CHECKED_SDP = ("sdp_jupyter installs from the shipped source package and its engine builds, in a fresh "
               "environment without sdp_jupyter (with this machine's compiler, at -O0 to save time: "
               "SDP_BUILD_QUICK), and serves smddp on every host")
#: What only AWS can show (shown in its summary).
NOT_CHECKED = (
    "service quotas and instance capacity",
    "IAM: the role, its trust policy and its access to the buckets",
    "the real training image and its packages (the hosts run this machine's Python and torch)",
    "GPUs, NCCL, EFA and SageMaker's own smddp library (with --engine aws, smddp is played by gloo here)",
    "real S3 data (channels are served from the local folders given)",
)

# A stand-in for SageMaker's smdistributed.dataparallel in the rehearsal's "image": registers the
# "smddp" torch.distributed backend on gloo, so a job written for smddp runs its hosts here.
SMDDP_SHIM = '''"""sdp_jupyter rehearsal: SageMaker's smddp library played by gloo (not the real library)."""
import torch.distributed as dist


def _create(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("smddp", _create, devices=["cpu"])
'''

_CHANNEL_REF = re.compile(r"SM_CHANNEL_([A-Z0-9_]+)")


def channel_data(plan) -> dict[str, str]:
    """For every s3:// input channel, the local folder that serves it (the longest --rehearse-data
    prefix of its URI). SpecError naming the channel when one has none, or when a --rehearse-data
    URI serves no channel (a typo would otherwise leave a channel empty)."""
    served, used = {}, set()
    for name, uri in plan.opts.inputs.items():
        if not uri.startswith("s3://"):
            continue  # a local path: the SDK uploads it, as for a real job
        prefixes = [p for p in plan.opts.rehearse_data if uri.rstrip("/") == p or uri.startswith(p + "/")]
        if not prefixes:
            raise SpecError("--rehearse-data", f"input channel {name!r} reads {uri}, and a rehearsal cannot read "
                                               "S3: serve it from a local folder. Fix: --rehearse-data "
                                               f"{uri}=./data/{name}")
        best = max(prefixes, key=len)
        used.add(best)
        served[name] = best
    unused = sorted(set(plan.opts.rehearse_data) - used)
    if unused:
        channels = ", ".join(f"{n}={u}" for n, u in plan.opts.inputs.items()) or "none"
        raise SpecError("--rehearse-data", f"{unused[0]} is not the prefix of any input channel (channels: "
                                           f"{channels}). Fix: --input NAME={unused[0]}, or correct the URI")
    return served


def script_text(plan) -> str:
    spec = plan.spec
    return spec.code if spec.code is not None else Path(spec.script).read_text()


def check(plan) -> dict[str, str]:
    """Everything a rehearsal checks before any host starts, beyond what make_plan checked; returns
    channel -> the --rehearse-data prefix serving it."""
    served = channel_data(plan)
    code = script_text(plan)
    channels = {name.upper() for name in plan.opts.inputs}
    for ref in sorted(set(_CHANNEL_REF.findall(code))):
        if ref not in channels:
            given = ", ".join(sorted(plan.opts.inputs)) or "none"
            raise SpecError("--input", f"the script reads $SM_CHANNEL_{ref} but the job has no channel "
                                       f"{ref.lower()!r} (channels: {given}); on SageMaker it would fail on every "
                                       f"host. Fix: --input {ref.lower()}=s3://my-bucket/data/{ref.lower()}")
    try:
        compile(code, str(plan.spec.script or "the cell"), "exec")
    except SyntaxError as e:
        raise SpecError("script", f"does not compile ({e.msg}, line {e.lineno}); every host would fail "
                                  "at its first line") from None
    if backends.needs_gpus(plan.spec.backend):
        from sdp_jupyter.launch.host.ranks import gpu_count  # the kernel never imports torch

        short = backends.gpu_shortfall(plan.spec.backend, 1, gpu_count(), "this machine (a rehearsal runs the "
                                       "hosts here)", "rehearse with --backend gloo (the request is the same apart "
                                       "from SDP_BACKEND)")
        if short:
            raise SpecError(*short)
    return served


def describe(rehearsal: dict) -> str:
    """The summary lines of a rehearsal: what was checked, what only AWS can check."""
    hosts = rehearsal.get("hosts")
    lines = [f"Rehearsal on this machine ({hosts} local host(s); nothing was sent to AWS). Checked:"]
    lines += [f"  + {c}" for c in rehearsal.get("checked") or CHECKED]
    lines.append("Not checked (only AWS can): " + "; ".join(rehearsal.get("not_checked") or NOT_CHECKED) + ".")
    return "\n".join(lines)


def rehearse(launcher, plan, push_bytes):
    """Check, then submit `plan` to the local stand-in instead of AWS; return the SageMakerJob."""
    try:
        import importlib

        importlib.import_module("sagemaker.train")  # the SDK builds the request, as for a real job
        importlib.import_module("moto.server")
        from sdp_jupyter.testing import sagemaker_standin
    except ImportError as e:
        raise SpecError("--rehearse", f"needs the SageMaker SDK, moto and boto3 ({e}). "
                        "Fix: pip install -e '.[rehearse]' in your sdp_jupyter checkout (the extra "
                        "includes [sagemaker]; no package index serves sdp_jupyter)") from None
    served = check(plan)
    if plan.region and plan.region != sagemaker_standin.REGION:
        plan.warnings.append(f"--region {plan.region}: a rehearsal plays {sagemaker_standin.REGION}")
        print(f"[sdp_jupyter] note: {plan.warnings[-1]}")
    plan.region = sagemaker_standin.REGION
    if not plan.role:
        plan.role = sagemaker_standin.ROLE  # IAM is not rehearsed: any role ARN will do
    local = sagemaker_standin.shared()
    files = {uri: local.aws.serve_folder(uri, folder) for uri, folder in plan.opts.rehearse_data.items()}
    for name, uri in served.items():
        if not files[uri]:
            raise SpecError("--rehearse-data", f"channel {name!r}: {plan.opts.rehearse_data[uri]} holds no files")
    if not plan.output_root:  # the SDK would ask STS for the account: the stand-in's default bucket
        plan.output_root = f"s3://sagemaker-{sagemaker_standin.REGION}-{sagemaker_standin.ACCOUNT}"
    bucket = plan.output_root[len("s3://"):].split("/", 1)[0]
    plan.opts.bucket = plan.opts.bucket or bucket  # the SDK's code bucket, found without STS
    local.aws.make_bucket(plan.opts.bucket)
    local.aws.make_bucket(bucket)
    checked = list(CHECKED) + ([CHECKED_SDP] if plan.engine == "sdp" else [])
    rehearsal = {"endpoint": local.endpoint, "hosts": plan.spec.nodes, "checked": checked,
                 "not_checked": list(NOT_CHECKED),
                 "data": {name: plan.opts.rehearse_data[uri] for name, uri in served.items()}}

    def prepare(job):
        root = job.dir / REHEARSAL_DIR
        pythonpath = python = image_env = None
        if plan.engine == "sdp":  # an image without sdp_jupyter: the entry installs the shipped package
            python = sagemaker_standin.image_without("sdp_jupyter", Path(local.workdir) / "image-sdp")
            image_env = {"SDP_BUILD_QUICK": "1"}  # a rehearsal checks that the engine builds, not its speed
        elif plan.engine == "aws":
            pkg = root / "image-packages" / "smdistributed" / "dataparallel" / "torch"
            pkg.mkdir(parents=True, exist_ok=True)
            for d in (pkg, pkg.parent, pkg.parent.parent):
                (d / "__init__.py").touch()
            (pkg / "torch_smddp.py").write_text(SMDDP_SHIM)
            pythonpath = str(root / "image-packages")
        local.stand_in.expect(plan.base_name, workdir=root, pythonpath=pythonpath, python=python,
                              env=image_env)

    with sagemaker_standin.pointed_at(local.aws.env):
        job = launcher.submit(plan, push_bytes, extra={"rehearsal": rehearsal}, prepare=prepare)
    print("[sdp_jupyter] " + describe(rehearsal).replace("\n", "\n[sdp_jupyter] "))
    return job

