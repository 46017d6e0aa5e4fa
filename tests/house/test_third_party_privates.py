"""The private APIs of other libraries that sdp_jupyter still uses, each checked for the exact shape we
rely on, so that an upgrade that changes one fails here, loudly and by name, instead of somewhere deep
in a job (issue 12). When one of these fails: find the public replacement, or adapt the one caller
named in the test's docstring."""
from __future__ import annotations

import inspect


def test_torch_fake_process_group_carries_a_groups_name():
    """sdp_jupyter/torch/process_group.py `register_name_carrier`: FakeProcessGroup.Options with
    error_on_collective, FakeProcessGroup._create_internal, ProcessGroup._register_backend and
    _set_default_backend with BackendType.CUSTOM."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    opts = FakeProcessGroup.Options()
    opts.error_on_collective = True
    carrier = FakeProcessGroup._create_internal(0, 2, opts)
    assert carrier.size() == 2
    assert hasattr(dist.ProcessGroup, "_register_backend") and hasattr(dist.ProcessGroup, "_set_default_backend")
    assert dist.ProcessGroup.BackendType.CUSTOM is not None


def test_torch_fake_store_for_measure_mode():
    """sdp_jupyter/parallel/measure.py `fake_world`: torch.testing._internal.distributed.fake_pg.FakeStore."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    FakeStore()


def test_torch_adamw_init_group_takes_six_lists():
    """sdp_jupyter/parallel/measure.py: AdamW._init_group(group, params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs, state_steps) allocates the optimizer state without stepping."""
    import torch

    params = list(inspect.signature(torch.optim.AdamW._init_group).parameters)
    assert len(params) == 8, params  # self, group and six lists
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p])
    for group in opt.param_groups:
        opt._init_group(group, [], [], [], [], [], [])
    assert set(opt.state[p]) >= {"exp_avg", "exp_avg_sq", "step"}


def test_sagemaker_sdk_keeps_the_latest_training_job():
    """sdp_jupyter/launch/targets/sagemaker/submit.py: ModelTrainer._latest_training_job.training_job_name, read when
    the CreateTrainingJob request went through a client our request gate did not reach."""
    from sagemaker.train import ModelTrainer

    assert "_latest_training_job" in inspect.getsource(ModelTrainer)


def test_torch_counts_collectives_per_group_and_lists_live_groups():
    """sdp_jupyter/launch/rank/backend_check.py `_snapshot`: ProcessGroup._get_sequence_number_for_group()
    counts a gloo group's collectives (those of DDP's C++ reducer too), and
    distributed_c10d._world.pg_map holds every live group (the job's end report reads both)."""
    import torch
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    before = pg._get_sequence_number_for_group()
    pg.allreduce([torch.ones(2)]).wait()
    pg.broadcast([torch.ones(2)]).wait()
    assert pg._get_sequence_number_for_group() == before + 2
    assert isinstance(dist.distributed_c10d._world.pg_map, dict)
