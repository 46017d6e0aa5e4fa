"""The JobSetup form driven from Python: set values, read the hints, launch a real job."""
import html
import re
import time
from pathlib import Path

import pytest

import sdp_jupyter
from sdp_jupyter import jobsetup as setup_mod

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_job_setup.ipynb"

# The training code of notebooks/02_job_setup.ipynb (its %%sdp_cell train cell), read from the notebook
# so the test runs what a user runs.


def notebook_training_code() -> str:
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%sdp_cell train"):
            return cell.source.split("\n", 1)[1]
    raise AssertionError("the notebook has no '%%sdp_cell train' cell")


def text(html_widget) -> str:
    """What a person reads in an HTML widget: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", html_widget.value))


def make(**kw):
    base = dict(code="print('hi')", backend="gloo", cpus=64)
    base.update(kw)
    return sdp_jupyter.JobSetup(**base)


def spec_from_line(setup):
    """The JobSpec that %%sdp_train builds from the setup's generated line (the magic's own parser)."""
    from sdp_jupyter.launch import JobSpec
    from sdp_jupyter.magics import SdpMagics, parse_line

    line = setup.magic_line()
    assert line.startswith("%%sdp_train")
    return JobSpec.from_options(vars(parse_line(SdpMagics.sdp_train, line[len("%%sdp_train"):])),
                                code=setup.spec.code)


def test_the_setup_works_without_widgets_and_launches_a_job(tmp_path):
    """JobSetup is a model: with ipywidgets unimportable it still sets fields, says what it does, and
    launches a real job; only view() needs the widgets."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["ipywidgets"] = None  # import ipywidgets -> ImportError
import sdp_jupyter
s = sdp_jupyter.JobSetup(code="print('ran from the model')", backend="gloo", nodes=1, cpus=64,
                         per_gpu_batch=16, reference_batch=16, reference_lr=0.1, jobs_dir={str(tmp_path)!r})
s.set(nodes=2, rule="sqrt")
print("SUMMARY", s.summary().splitlines()[0])
print("LR", s.spec.hyperparameters["lr"])
job = s.launch()
print("STATE", job.wait(120), "RUNNING", s.running)
print("LOG", job.logs(0).strip())
try:
    s.view()
except ImportError as e:
    print("VIEW ImportError")
assert "ipywidgets" not in sys.modules or sys.modules["ipywidgets"] is None
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SUMMARY JobSetup: global batch 32, learning rate 0.141421" in p.stdout, p.stdout
    assert "LR 0.141421" in p.stdout and "STATE succeeded RUNNING False" in p.stdout, p.stdout
    assert "LOG ran from the model" in p.stdout and "VIEW ImportError" in p.stdout, p.stdout


def test_changes_made_in_code_show_in_the_form_and_bad_choices_are_refused():
    s = make(nodes=1, per_gpu_batch=16, reference_batch=16, reference_lr=0.01)
    v = s.view()
    assert s.view() is v  # one form per setup: every display of it stays in step
    s.set(nodes=4, warmup_epochs="2")
    assert v.w_nodes.value == 4 and v.w_warmup.value == "2" and "global batch 64" in text(v.w_global)
    v.w_rule.value = "sqrt"
    assert s.values["rule"] == "sqrt" and s.plan.rule == "sqrt"
    s.set(target="sagemaker")
    assert v.w_instance.value == "ml.p4d.24xlarge" and s.values["procs_per_node"] == 8 and v.w_gpus.value == 8
    with pytest.raises(ValueError, match="rule must be one of"):
        s.set(rule="cubic")
    with pytest.raises(KeyError):
        s.set(instance_type="ml.nope.large")
    with pytest.raises(TypeError, match="unknown field"):
        s.set(node=2)
    assert s.values["rule"] == "sqrt" and s.values["instance_type"] == "ml.p4d.24xlarge"


def test_presets_show_global_batch_lr_and_iterations():
    s = make(nodes=2, procs_per_node=2, per_gpu_batch=64, reference_batch=64, reference_lr=0.05,
             dataset_size=10_000, epochs=4)
    assert "global batch 256 = 2 nodes x 2 GPUs x 64 per GPU" in text(s.view().w_global)
    assert "learning rate 0.2 (linear rule: x4" in text(s.view().w_lr)
    assert "iterations / epoch39" in text(s.view().w_hints)  # 10000 // 256
    assert not s.view().w_launch.disabled and s.view().w_reason.value == ""


def test_changing_nodes_updates_the_hints_live():
    s = make(per_gpu_batch=32, reference_batch=32, reference_lr=0.01, dataset_size=100_000)
    assert "global batch 32" in text(s.view().w_global) and "learning rate 0.01" in text(s.view().w_lr)
    s.view().w_nodes.value = 4
    assert "global batch 128" in text(s.view().w_global)
    assert "learning rate 0.04" in text(s.view().w_lr)
    assert s.spec.hyperparameters["lr"] == 0.04 and s.spec.nodes == 4
    s.view().w_rule.value = "sqrt"
    assert "learning rate 0.02" in text(s.view().w_lr)


def test_keep_global_mode_shows_the_seed_batchnorm_warning():
    s = make(mode="keep_global", reference_batch=64, nodes=4, procs_per_node=8, batchnorm=True, dataset_size=50_000)
    assert s.view().w_per_gpu.disabled
    assert "global batch 64 = 4 nodes x 8 GPUs x 2 per GPU" in text(s.view().w_global)
    assert "data-code='batchnorm_small_batch'" in s.view().w_warnings.value
    assert "per-GPU batch 2 is below 16" in text(s.view().w_warnings)
    assert not s.view().w_launch.disabled  # a warning, not an error
    s.view().w_mode.value = "keep per-GPU batch"
    assert not s.view().w_per_gpu.disabled and "batchnorm_small_batch" not in s.view().w_warnings.value


def test_invalid_combinations_disable_launch_and_say_why():
    s = make(per_gpu_batch=64, dataset_size=50)
    assert s.view().w_launch.disabled
    assert "global batch 64 is larger than the dataset (50 samples)" in text(s.view().w_reason)
    with pytest.raises(ValueError, match="larger than the dataset"):
        s.spec
    s.view().w_dataset.value = 6400
    assert not s.view().w_launch.disabled
    s.view().w_warmup.value = "five"
    assert s.view().w_launch.disabled and "warm-up epochs: 'five' is not a number" in text(s.view().w_reason)
    s.view().w_warmup.value = "1.5"
    assert not s.view().w_launch.disabled and s.spec.hyperparameters["warmup_epochs"] == 1.5
    s.view().w_nodes.value = 100
    assert "oversubscribed" in s.view().w_warnings.value and "100 local worker processes on 64" in text(s.view().w_warnings)


def test_sagemaker_target_takes_gpus_from_the_instance_and_checks_smddp():
    s = make(backend="smddp", nodes=2, per_gpu_batch=32, dataset_size=1_000_000)
    s.view().w_target.value = "sagemaker"
    assert s.view().w_instance.value == "ml.p4d.24xlarge" and s.view().w_gpus.value == 8 and s.view().w_gpus.disabled
    assert "8 x NVIDIA A100 40 GB" in text(s.view().w_instance_info)
    assert "smddp (engine auto): SageMaker's smdistributed library" in text(s.view().w_instance_info)
    assert "global batch 512 = 2 nodes x 8 GPUs x 32 per GPU" in text(s.view().w_global)
    spec = s.spec
    assert spec.target == "sagemaker" and spec.procs_per_node == 8
    assert spec.sagemaker == {"instance_type": "ml.p4d.24xlarge"}
    # every SageMaker option of the spec is either in the %%sdp_train line or listed next to it
    shown = text(s.view().w_magic)
    assert "--instance-type ml.p4d.24xlarge" in shown or "instance_type=ml.p4d.24xlarge" in shown
    s.view().w_instance.value = "ml.g5.48xlarge"  # engine auto: ours there, said in the warnings
    assert not s.view().w_launch.disabled and "served by sdp_jupyter's engine" in text(s.view().w_warnings)
    assert "smddp (engine auto): sdp_jupyter's engine" in text(s.view().w_instance_info)
    s.target_options.setdefault("sagemaker", {})["engine"] = "aws"  # SageMaker's library only: refused on that type
    s.view().w_instance.value = "ml.p4d.24xlarge"
    s.view().w_instance.value = "ml.g5.48xlarge"
    assert s.view().w_launch.disabled and "does not support ml.g5.48xlarge" in text(s.view().w_reason)
    s.view().w_target.value = "local"
    assert s.view().w_instance.value == "local" and not s.view().w_gpus.disabled


def test_ssh_and_ray_targets_ask_for_hosts_or_address_and_put_them_in_the_spec_and_the_line():
    s = make(backend="smddp", nodes=2, per_gpu_batch=32, ssh={"config": "/etc/ssh/team_config"})
    assert s.view().w_form_boxes["ssh"].layout.display == "none"
    s.view().w_target.value = "ssh"
    assert s.view().w_form_boxes["ssh"].layout.display is None and s.view().w_instance.layout.display == "none"
    assert s.view().w_launch.disabled and "SSH hosts: enter the host names" in text(s.view().w_reason)
    s.view().w_form["hosts"].value = "gpu1, gpu2"
    assert not s.view().w_launch.disabled
    spec = s.spec
    assert spec.target == "ssh" and spec.ssh == {"config": "/etc/ssh/team_config", "hosts": ["gpu1", "gpu2"]}
    assert "--target ssh" in text(s.view().w_magic) and "--hosts gpu1,gpu2" in text(s.view().w_magic)
    s.view().w_target.value = "local"
    assert s.view().w_form_boxes["ssh"].layout.display == "none" and s.spec.ssh == {}
    s.view().w_target.value = "ray"  # the address may stay empty: $RAY_ADDRESS, else auto
    assert s.view().w_form_boxes["ray"].layout.display is None and not s.view().w_launch.disabled and s.spec.ray == {}
    s.view().w_form["ray_address"].value = "10.0.0.5:6379"
    assert s.spec.target == "ray" and s.spec.ray == {"address": "10.0.0.5:6379"}
    assert "--target ray" in text(s.view().w_magic) and "--address 10.0.0.5:6379" in text(s.view().w_magic)


def test_slurm_target_shows_its_fields_and_the_spec_gets_only_those_filled_in():
    s = make(backend="smddp", nodes=2, per_gpu_batch=32, dataset_size=1_000_000)
    v = s.view()
    assert "slurm" in v.w_target.options and v.w_form_boxes["slurm"].layout.display == "none"
    v.w_target.value = "slurm"
    # the Slurm fields shown; the other targets' fields and the instance type hidden; nodes and
    # processes per node stay the user's, as for SSH
    assert v.w_form_boxes["slurm"].layout.display is None
    assert [w.description for w in v.w_form_boxes["slurm"].children] == ["Partition", "Account", "Time limit",
                                                           "More sbatch options"]
    assert v.w_form_boxes["ssh"].layout.display == "none" and v.w_form_boxes["ray"].layout.display == "none"
    assert v.w_instance.layout.display == "none" and v.w_instance_info.layout.display == "none"
    assert not v.w_gpus.disabled and not v.w_launch.disabled
    v.w_gpus.value = 4  # (switching target set it to this machine's GPU count, as for SSH)
    spec = s.spec
    assert (spec.target, spec.nodes, spec.procs_per_node, spec.slurm) == ("slurm", 2, 4, {})  # Slurm's defaults
    assert "--target slurm" in text(v.w_magic) and "--partition" not in text(v.w_magic)
    v.w_form["slurm_partition"].value = "gpu"
    v.w_form["slurm_time"].value = " 1:30:00 "
    v.w_form["slurm_args"].value = "--qos=high"  # the account left empty: left out, not sent as ""
    assert s.spec.slurm == {"partition": "gpu", "time": "1:30:00", "args": "--qos=high"}
    line = s.magic_line()
    assert "--partition gpu" in line and "--time 1:30:00" in line and "--slurm-args=--qos=high" in line
    assert "--account" not in line and line in text(v.w_magic)
    assert spec_from_line(s) == s.spec  # through %%sdp_train's parser to the same JobSpec
    v.w_form["slurm_account"].value = "ml-team"
    v.w_form["slurm_args"].value = "--qos=high --gpus-per-node=4"
    assert s.spec.slurm["account"] == "ml-team" and spec_from_line(s) == s.spec
    # the user's own machines, as for SSH: no instance type to price, no local oversubscription warning
    assert s.outcome.instance.is_local and v.w_price.placeholder == "n/a for slurm"
    v.w_throughput.value = "100"
    assert s.outcome.estimate.cost_per_run is None and "unknown (enter USD per node-hour)" in text(v.w_hints)
    v.w_nodes.value = 64
    assert "oversubscribed" not in v.w_warnings.value
    v.w_target.value = "local"
    assert v.w_form_boxes["slurm"].layout.display == "none" and s.spec.slurm == {}


def test_slurm_fields_preset_from_jobsetup_and_sdp_setup():
    s = make(target="slurm", nodes=2, slurm={"partition": "gpu", "time": 30, "account": ""})
    assert s.view().w_form["slurm_partition"].value == "gpu" and s.view().w_form["slurm_time"].value == "30"
    assert s.spec.slurm == {"partition": "gpu", "time": "30"}
    s.set(slurm_partition="", slurm_args="-C v100")
    assert s.spec.slurm == {"time": "30", "args": "-C v100"} and spec_from_line(s) == s.spec
    with pytest.raises(TypeError, match="unknown slurm option.*qos.*known: partition, account, time, args"):
        make(slurm={"qos": "high"})
    setup_mod.store_cell("slurm_cell", "print('on slurm')\n")
    t = setup_mod.setup_from_line("--cell slurm_cell --target slurm --nodes 3 --partition gpu --account ml "
                                  "--slurm-args='--qos=high' --backend gloo")
    assert t.spec.target == "slurm" and t.spec.nodes == 3
    assert t.spec.slurm == {"partition": "gpu", "account": "ml", "args": "--qos=high"}
    assert t.view().w_form_boxes["slurm"].layout.display is None and t.view().w_form["slurm_account"].value == "ml"


def test_estimates_follow_throughput_efficiency_and_price():
    s = make(target="sagemaker", instance_type="ml.p4d.24xlarge", backend="smddp", nodes=2, per_gpu_batch=64,
             dataset_size=1_024_000, epochs=10)
    assert "enter a measured throughput" in text(s.view().w_hints)
    s.view().w_throughput.value = "1000"  # 16 GPUs x 1000 x 0.9 = 14400 samples/s; 1000 steps x 1024 samples
    assert "71.1 s / epoch" in text(s.view().w_hints) and "unknown (enter USD per node-hour)" in text(s.view().w_hints)
    s.view().w_price.value = "36"
    est = s.outcome.estimate
    assert est.cost_per_epoch == pytest.approx(1_024_000 / 14_400 / 3600 * 2 * 36)
    assert f"${est.cost_per_epoch:,.2f} / epoch" in text(s.view().w_hints)
    s.view().w_efficiency.value = 0.5
    assert s.outcome.estimate.epoch_seconds == pytest.approx(1_024_000 / 8000)


def test_magic_line_reproduces_the_spec():
    s = make(nodes=3, per_gpu_batch=16, reference_batch=16, reference_lr=0.02, dataset_size=4800,
             hyperparameters={"momentum": 0.9}, name="mnist-3n")
    line = s.magic_line()
    assert line.startswith("%%sdp_train") and "--hp momentum=0.9" in line and "--hp lr=0.06" in line
    assert spec_from_line(s) == s.spec


def test_magic_line_for_a_script_runs_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('x')\n")
    s = make(code=None, script=str(script))
    assert s.spec.script == str(script)
    assert s.magic_line().splitlines()[1] == f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    missing = make(code=None, script=str(tmp_path / "nope.py"))
    assert missing.view().w_launch.disabled and "nope.py' not found" in text(missing.view().w_reason)


def test_cells_by_name_and_the_magics():
    setup_mod.store_cell("demo_cell", "x = 1\nprint(x)\n")
    s = sdp_jupyter.JobSetup(cell="demo_cell", backend="gloo", cpus=64)
    assert s.spec.code == "x = 1\nprint(x)\n"
    empty = sdp_jupyter.JobSetup(backend="gloo", cpus=64)
    assert empty.view().w_launch.disabled and "nothing to run" in text(empty.view().w_reason)
    assert empty.attach(cell="demo_cell") is empty and not empty.view().w_launch.disabled
    assert empty.spec.code == "x = 1\nprint(x)\n"
    with pytest.raises(SyntaxError):
        setup_mod.store_cell("broken", "def f(:\n")
    with pytest.raises(KeyError, match="%%sdp_cell nope"):
        sdp_jupyter.JobSetup(cell="nope")
    t = setup_mod.setup_from_line("--cell demo_cell --nodes 3 --per-gpu-batch 8 --batchnorm yes --backend gloo")
    assert t.plan.nodes == 3 and t.plan.batchnorm and "global batch 24" in text(t.view().w_global)
    with pytest.raises(ValueError, match="usage"):
        setup_mod.setup_from_line("--nodes many")
    with pytest.raises(TypeError, match="unknown field"):
        sdp_jupyter.JobSetup(code="pass", node=2)


def test_magics_register_on_a_real_shell():
    from IPython.testing.globalipapp import get_ipython

    from sdp_jupyter.magics import SdpMagics

    shell = get_ipython()  # the one shell the other magic tests use (IPython allows one per process)
    shell.register_magics(SdpMagics)
    shell.run_cell("%%sdp_cell shell_cell\nprint('from the shell')\n")
    assert setup_mod.CELLS["shell_cell"] == "print('from the shell')\n"
    res = shell.run_cell("%sdp_setup --cell shell_cell --nodes 2 --backend gloo")
    assert isinstance(res.result, sdp_jupyter.JobSetup) and res.result.plan.nodes == 2
    # built with magic_arguments: `%sdp_setup?` lists the options, a bad one is a UsageError
    assert "--per-gpu-batch" in SdpMagics.sdp_setup.__doc__ and "--cell" in SdpMagics.sdp_setup.__doc__
    assert "a cell stored with %%sdp_cell NAME" in SdpMagics.sdp_setup.__doc__  # argparse %-formats help
    res = shell.run_cell("%sdp_setup --nodes many")
    assert res.error_in_exec is not None and type(res.error_in_exec).__name__ == "UsageError"
    res = shell.run_cell("%%sdp_cell broken\ndef f(:\n")
    assert "syntax error on line 2 of the cell" in str(res.error_in_exec)


@pytest.mark.slow
def test_launch_runs_a_real_job_with_the_hyperparameters(jobs_dir):
    """Click Launch: two gloo ranks run the notebook's training code, read --lr and SM_HPS, succeed
    (the jobs_dir fixture also fails the test if a worker outlives it)."""
    s = sdp_jupyter.JobSetup(code=notebook_training_code(), backend="gloo", nodes=1, procs_per_node=1,
                             per_gpu_batch=32, reference_batch=32, reference_lr=0.01, dataset_size=2048, epochs=2,
                             jobs_dir=str(jobs_dir), name="setup-widget-test")
    s.view().w_nodes.value = 2  # global batch 64, linear rule: LR 0.02
    assert s.spec.hyperparameters["lr"] == 0.02
    s.view().w_launch.click()
    job = s.job
    assert job is not None and len(s.view().w_job.children) == 1
    assert job.wait(180) == "succeeded", job.logs(0) + job.logs(1)
    log = job.logs(0)
    assert "lr 0.02 world 2 batch 32 steps 32" in log, log
    deadline = time.monotonic() + 30  # the form updates from the launcher's thread, after wait() returns
    while s.view().w_launch.disabled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "succeeded" in s.view().w_status.value and not s.view().w_launch.disabled
    assert Path(job.dir, "spec.json").is_file()
    # the training code reported samples: the form offers the measured per-GPU throughput
    per_rank, ranks = s.measured
    assert ranks == 2 and per_rank > 0
    assert "samples/s per GPU on 2 ranks" in text(s.view().w_measured)
    assert "enter a measured throughput" in text(s.view().w_hints)
    s.view().w_use_measured.click()
    assert float(s.view().w_throughput.value) == pytest.approx(per_rank / 0.9, rel=1e-5)  # as a one-GPU figure
    est = s.outcome.estimate  # at the measured world size it gives back the measured rate
    assert est.samples_per_second == pytest.approx(2 * per_rank, rel=1e-5)
    assert est.epoch_seconds == pytest.approx(32 * 64 / (2 * per_rank), rel=1e-5)


def write_steps(job_dir: Path, ranks: int, samples: int, dt: float, steps: int = 10) -> Path:
    """Metrics as report(samples=...) writes them: each rank `samples` per step, a step every `dt` s."""
    import json

    (job_dir / "metrics").mkdir(parents=True)
    for rank in range(ranks):
        lines = [json.dumps({"t": 1000.0 + dt * i, "kind": "step", "rank": rank, "step": i, "samples": samples})
                 for i in range(steps)]
        (job_dir / "metrics" / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return job_dir


def test_measured_throughput_reads_reported_samples(tmp_path):
    """Hand-made metrics: 2 ranks, steps of 32 samples each 0.1 s apart -> 320 samples/s per rank."""
    import json

    write_steps(tmp_path, ranks=2, samples=32, dt=0.1)
    per_rank, ranks = setup_mod.measured_throughput(tmp_path)
    assert ranks == 2 and per_rank == pytest.approx(320, rel=0.01)
    (tmp_path / "metrics" / "rank-0.jsonl").write_text("")
    (tmp_path / "metrics" / "rank-1.jsonl").write_text(json.dumps({"t": 1.0, "kind": "step", "rank": 1, "step": 0}))
    assert setup_mod.measured_throughput(tmp_path) is None


def test_one_rank_and_four_rank_measurements_give_the_scaling_efficiency(tmp_path):
    s = make(nodes=4, per_gpu_batch=32, reference_batch=32, dataset_size=128_000)
    s.measure(write_steps(tmp_path / "one", ranks=1, samples=32, dt=0.1))   # 320 samples/s alone
    assert s.measured_efficiency() is None
    s.measure(write_steps(tmp_path / "four", ranks=4, samples=32, dt=0.125))  # 256 per rank together
    eff, n = s.measured_efficiency()
    assert n == 4 and eff == pytest.approx(0.8, rel=0.01)
    assert "scaling efficiency 0.80 at 4 ranks vs 1 rank alone" in text(s.view().w_measured)
    s.view().w_use_measured.click()
    assert float(s.view().w_throughput.value) == pytest.approx(320, rel=0.01)
    assert s.view().w_efficiency.value == pytest.approx(0.8, rel=0.01)
    # 4 ranks x 320 x 0.8 = 1024 samples/s: the estimate gives back the 4-rank measurement
    assert s.outcome.estimate.samples_per_second == pytest.approx(4 * 256, rel=0.01)


@pytest.mark.slow
def test_the_notebook_runs_headless(tmp_path):
    """notebooks/02_job_setup.ipynb runs top to bottom in a real kernel (nbclient)."""
    import os

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SDP_JOBS_DIR"] = str(tmp_path)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.km = client.create_kernel_manager()
    client.start_new_kernel(env=env)
    client.start_new_kernel_client()
    try:
        client.execute(cleanup_kc=False)
    finally:
        client._cleanup_kernel()
    outputs = {i: "".join(o.get("text", "") for o in c.get("outputs", [])) for i, c in enumerate(nb.cells)
               if c.cell_type == "code"}
    joined = "\n".join(outputs.values())
    assert "stored cell 'train'" in joined
    assert "'global_batch_size': 32" in joined and "%%sdp_train --procs-per-node 1 --backend gloo" in joined
    assert "2 64 0.05" in joined  # the seed example: 2 per GPU, global 64, LR kept
    assert "per-GPU batch 2 is below 16" in joined
    widgets = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 2  # the form and the %sdp_setup form


@pytest.mark.slow
def test_launch_on_sagemaker_sends_the_same_hyperparameters():
    """Target SageMaker against the local moto control plane (tests/helpers/moto.py): Launch sends
    CreateTrainingJob with the form's instance type, count and hyperparameters; the job follows the
    service's status to 'succeeded'."""
    pytest.importorskip("sagemaker.train")
    pytest.importorskip("moto.server")
    import logging
    import tempfile

    from helpers.moto import BUCKET, ROLE, MotoAWS, moto_aws

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp, moto_aws(tmp) as aws:
        s = sdp_jupyter.JobSetup(code=notebook_training_code(), target="sagemaker", instance_type="ml.p4d.24xlarge",
                                 nodes=2, backend="smddp", per_gpu_batch=64, reference_batch=256, reference_lr=0.1,
                                 dataset_size=1_281_167, epochs=90, name="setup-sm", jobs_dir=tmp,
                                 sagemaker={"role": ROLE, "bucket": BUCKET, "poll_interval": 0.1})
        assert "global batch 1024 = 2 nodes x 8 GPUs x 64 per GPU" in text(s.view().w_global)
        s.view().w_launch.click()
        job = s.job
        req = MotoAWS.create_requests[-1]
        assert req["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
        assert req["ResourceConfig"]["InstanceCount"] == 2
        hps = s.spec.hyperparameters
        assert req["HyperParameters"] == {k: str(v) for k, v in hps.items()}
        assert req["HyperParameters"]["lr"] == "0.4" and req["HyperParameters"]["global_batch_size"] == "1024"
        aws.set_status(req["TrainingJobName"], "Completed")
        assert job.wait(30) == "succeeded"
        deadline = time.monotonic() + 30
        while "succeeded" not in s.view().w_status.value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "succeeded" in s.view().w_status.value
