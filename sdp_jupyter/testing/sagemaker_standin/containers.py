"""The SageMaker half of the stand-in: the training container, run here. SageMaker's own driver
(sm_drivers' torchrun_driver.py, environment.py) on the job's channels as uploaded to (moto's) S3,
one process tree per host (`LocalContainers`), and the thread that plays the service for every
CreateTrainingJob the server receives (`SageMakerStandIn`); `image_without` makes the rehearsal's
training "image"."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from sdp_jupyter.testing.sagemaker_standin.server import MotoAWS
from sdp_jupyter._net import free_port


def download_channel(aws: MotoAWS, uri: str, dest) -> None:
    """Copy every object under an s3:// prefix (from moto) into the folder `dest`."""
    from pathlib import Path

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = aws.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = Path(dest) / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))


_SET_ENV = r"""
import json, os, sys
drivers, out, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, os.path.join(drivers, "scripts"))
import environment  # SageMaker's own: sm_drivers/scripts/environment.py
# it reads these two from /opt/ml/input/data/sm_drivers; ours are under the test's tmp dir
environment.read_source_code_json = lambda: json.load(open(os.path.join(drivers, "sourcecode.json")))
environment.read_distributed_json = lambda: json.load(open(os.path.join(drivers, "distributed.json")))
environment.set_env(config["resource"], config["channels"], config["hyperparameters"], output_file=out)
"""


def container_env(drivers, host: int, hosts: int, request: dict, root, port: int, python: str | None = None) -> dict:
    """The environment of host `host` (1-based) as SageMaker's environment.py computes it; /opt/ml is
    `root`/opt/ml and algo-1 (SM_MASTER_ADDR) is 127.0.0.1:`port` (the only differences). `python`:
    the image's interpreter (its folder goes first on PATH, for torchrun), default this one."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(root)
    resource = {"current_host": f"algo-{host}", "current_instance_type": request["ResourceConfig"]["InstanceType"],
                "hosts": [f"algo-{h}" for h in range(1, hosts + 1)], "network_interface_name": "lo"}
    channels = {c["ChannelName"]: {"TrainingInputMode": "File"} for c in request.get("InputDataConfig", [])}
    root.mkdir(parents=True, exist_ok=True)
    out = root / "sm_training.env"
    config = {"resource": resource, "channels": channels, "hyperparameters": request.get("HyperParameters", {})}
    done = subprocess.run([sys.executable, "-c", _SET_ENV, str(drivers), str(out), json.dumps(config)],
                          env={**os.environ, "TRAINING_JOB_NAME": request["TrainingJobName"]},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "SDP_", "SM_", "JPY_"))}
    env.pop("PYTHONPATH", None)  # the job must find sdp_jupyter in its own source directory
    env.update(request.get("Environment", {}))
    for line in out.read_text().splitlines():
        key, _, value = line[len("export "):].partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    opt_ml = root / "opt" / "ml"
    for key, value in list(env.items()):
        if value.startswith("/opt/ml"):
            env[key] = str(opt_ml) + value[len("/opt/ml"):]
    env.update({
        "TRAINING_JOB_NAME": request["TrainingJobName"],
        "SM_MASTER_ADDR": "127.0.0.1", "SM_MASTER_PORT": str(port),  # algo-1 does not resolve here
        "GLOO_SOCKET_IFNAME": "lo",
        "PATH": f"{Path(python or sys.executable).parent}:{env.get('PATH', '')}",  # the image's torchrun
    })
    for sub in ("model", "output/data", "checkpoints"):
        (opt_ml / sub).mkdir(parents=True, exist_ok=True)
    for name in channels:
        (opt_ml / "input" / "data" / name).mkdir(parents=True, exist_ok=True)
    return env


class LocalContainers:
    """Runs one training job's hosts here, the way SageMaker runs them: the `code` and `sm_drivers`
    channels downloaded from (moto's) S3 as uploaded, every other S3 channel downloaded too, and
    SageMaker's own torchrun_driver.py per host with cwd /opt/ml/input/data/code."""

    def __init__(self, aws: MotoAWS, request: dict, workdir, python: str | None = None):
        import sys
        from pathlib import Path

        self.aws = aws
        self.python = python or sys.executable  # the image's Python
        self.request = request
        self.name = request["TrainingJobName"]
        self.hosts = int(request["ResourceConfig"]["InstanceCount"])
        self.workdir = Path(workdir) / self.name
        self.procs = []

    def prepare(self) -> None:
        uris = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"]
                for c in self.request.get("InputDataConfig", [])}
        self.code, self.drivers = self.workdir / "image" / "code", self.workdir / "image" / "sm_drivers"
        download_channel(self.aws, uris.pop("code"), self.code)
        download_channel(self.aws, uris.pop("sm_drivers"), self.drivers)
        port = free_port()
        self.envs = []
        for host in range(1, self.hosts + 1):
            root = self.workdir / f"algo-{host}"
            env = container_env(self.drivers, host, self.hosts, self.request, root, port, self.python)
            for channel, uri in uris.items():
                download_channel(self.aws, uri, env[f"SM_CHANNEL_{channel.upper()}"])
            if self.checkpoint_uri:  # SageMaker restores the checkpoint URI into every host's LocalPath
                download_channel(self.aws, self.checkpoint_uri, self.checkpoint_dir(env))
            self.envs.append(env)

    @property
    def checkpoint_uri(self) -> str | None:
        return (self.request.get("CheckpointConfig") or {}).get("S3Uri")

    def checkpoint_dir(self, env: dict) -> str:
        local = (self.request.get("CheckpointConfig") or {}).get("LocalPath", "/opt/ml/checkpoints")
        return env["SM_MODEL_DIR"][:-len("/model")] + local[len("/opt/ml"):]

    def sync_checkpoints(self) -> None:
        """What SageMaker does during training: every host's LocalPath is uploaded to the URI."""
        from pathlib import Path

        bucket, _, prefix = self.checkpoint_uri[len("s3://"):].partition("/")
        for env in self.envs:
            root = Path(self.checkpoint_dir(env))
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                self.aws.client("s3").upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root)}")

    def start(self) -> None:
        import subprocess

        for env in self.envs:
            self.procs.append(subprocess.Popen(
                [self.python, str(self.drivers / "distributed_drivers" / "torchrun_driver.py")],
                cwd=self.code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))

    def kill(self) -> None:
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SageMakerStandIn:
    """Plays SageMaker for every training job created on the moto server: runs its hosts here
    (LocalContainers), streams each host's output into its CloudWatch log stream as it comes,
    publishes the hosts' CPU utilisation, uploads output.tar.gz from algo-1's /opt/ml/output/data,
    and ends the job Completed, or Failed with the failure file as FailureReason. One job at a
    time."""

    def __init__(self, aws: MotoAWS, workdir):
        self.aws = aws
        self.workdir = workdir
        # per job (Environment SDP_JOB_NAME): {"workdir": where its /opt/ml trees go,
        # "pythonpath": prepended on every host (the image's packages), "python": the image's
        # interpreter, "env": the image's own variables}; see `expect`
        self.jobs: dict[str, dict] = {}
        self.seen = len(MotoAWS.create_requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sagemaker-stand-in", daemon=True)
        self.errors: list[str] = []

    def start(self) -> "SageMakerStandIn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def expect(self, job_name: str, workdir=None, pythonpath: str | None = None, python: str | None = None,
               env: dict | None = None) -> None:
        """Where the hosts of the next job named `job_name` (its SDP_JOB_NAME) run, what they import,
        which Python runs them (default: this process's; see `image_without`) and what the image's
        environment adds (`env`)."""
        self.jobs[job_name] = {"workdir": workdir, "pythonpath": pythonpath, "python": python, "env": env}

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            while self.seen < len(MotoAWS.create_requests):
                request = MotoAWS.create_requests[self.seen]
                self.seen += 1
                try:
                    self.run(request)
                except Exception as e:  # shown by whoever owns the stand-in (`errors`)
                    self.errors.append(f"{request.get('TrainingJobName')}: {type(e).__name__}: {e}")

    def run(self, request: dict) -> None:
        import io
        import tarfile

        name = request["TrainingJobName"]
        options = self.jobs.pop((request.get("Environment") or {}).get("SDP_JOB_NAME"), None) or {}
        self.aws.set_status(name, "InProgress", "Downloading", message="Downloading the training image")
        containers = LocalContainers(self.aws, request, options.get("workdir") or self.workdir,
                                     python=options.get("python"))
        containers.prepare()
        for env in containers.envs:
            env.update(options.get("env") or {})
            if options.get("pythonpath"):
                env["PYTHONPATH"] = options["pythonpath"]
        self.aws.set_status(name, "InProgress", "Training",
                            message="Training image download completed. Training in progress.")
        containers.start()
        readers = [threading.Thread(target=self._pipe, args=(name, h + 1, p), daemon=True)
                   for h, p in enumerate(containers.procs)]
        for r in readers:
            r.start()
        codes, failed = [], []  # failed: hosts (0-based) in the order their algorithm failed
        try:
            while True:
                failed += [h for h, p in enumerate(containers.procs) if p.poll() not in (None, 0) and h not in failed]
                if failed or all(p.poll() is not None for p in containers.procs):
                    break  # SageMaker ends the job when one host's algorithm fails
                if self._stop.is_set() or self.aws.status(name) in ("Stopping", "Stopped"):
                    break
                time.sleep(0.2)
        finally:
            containers.kill()
            for r in readers:
                r.join(timeout=10)
            codes = [p.returncode for p in containers.procs]
        for host in range(1, containers.hosts + 1):
            self.aws.put_host_metric(name, host, "CPUUtilization", 100.0)
        if self.aws.status(name) in ("Stopping", "Stopped"):
            self.aws.set_status(name, "Stopped")
            return
        self.aws.set_status(name, "InProgress", "Uploading", message="Uploading generated training model")
        data = containers.workdir / "algo-1" / "opt" / "ml" / "output" / "data"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(str(data), arcname=".")
        root = request["OutputDataConfig"]["S3OutputPath"][len("s3://"):].rstrip("/")
        bucket, _, prefix = root.partition("/")
        key = f"{prefix}/{name}/output/output.tar.gz".lstrip("/")
        self.aws.client("s3").put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        if all(c == 0 for c in codes):
            self.aws.set_status(name, "Completed")
            return
        reason = "AlgorithmError: the training script failed"
        # the first failure: the earliest failure file (a host's peers fail after it, e.g. gloo's
        # "connection closed"), else the host whose algorithm was seen failing first
        order = failed + [h for h in range(containers.hosts) if h not in failed]
        written = [(os.path.getmtime(f), order.index(h), f) for h, f in
                   ((h, env.get("SM_OUTPUT_FAILURE")) for h, env in enumerate(containers.envs))
                   if f and os.path.exists(f)]
        if written:
            with open(min(written)[2]) as f:
                reason = f"AlgorithmError: {f.read().strip()}"
        self.aws.set_status(name, "Failed", failure_reason=reason)

    def _pipe(self, name: str, host: int, proc) -> None:
        for line in proc.stdout:
            if line.strip():  # CloudWatch Logs takes no empty events
                self.aws.put_log_lines(name, host, [line.rstrip("\n")])


def image_without(package: str, root) -> str:
    """A training "image" for the rehearsal's hosts: a virtual environment at `root` that sees every
    package of this Python except `package` (each linked from one folder a .pth file names), with
    a `torchrun`; return its interpreter. Made once per `root`: what is installed into it stays, as
    in an image reused for the next job. This is how a rehearsal with --engine sdp checks that the
    shipped source package installs and its engine builds, without downloading torch."""
    import site
    import subprocess
    import sys
    from pathlib import Path

    root = Path(root)
    python = root / "bin" / "python"
    if python.exists():
        return str(python)
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    own = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    linked = root / "image-packages"
    linked.mkdir(exist_ok=True)
    name = package.replace("-", "_").lower()
    for folder in site.getsitepackages():
        if not os.path.isdir(folder) or Path(folder).resolve() == own.resolve():
            continue
        for entry in Path(folder).iterdir():
            lower = entry.name.lower()
            if name in lower or lower.endswith(".pth") or lower == "__pycache__" or (linked / entry.name).exists():
                continue  # the package itself, its editable finder and .pth hooks
            (linked / entry.name).symlink_to(entry)
    (own / "image-packages.pth").write_text(f"{linked}\n")
    torchrun = root / "bin" / "torchrun"
    torchrun.write_text(f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    return str(python)

