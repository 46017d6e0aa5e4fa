"""A few minutes of the chaos soak (tests/helpers/chaos.py; 30 minutes of it: benchmarks/elastic_churn.py):
one job on the SSH test hosts (elastic, then --heal) meets every kind of fault it is built to survive in
turn, recovers from each, and ends with the weights of the same training run uninterrupted in one process,
leaving no process on any host."""
from __future__ import annotations

import os

import pytest

from helpers.chaos import HEAL_KINDS, KINDS, Soak, reference

pytestmark = pytest.mark.slow


def test_reference_weights_do_not_depend_on_how_many_ranks_computed_them():
    """The soak's promise in one process: the fixed-point sum of the micro-batches' gradients is the same
    bits whether 1, 2 or 3 ranks computed them (and differs when a step is missing)."""
    import torch

    space: dict = {}
    from helpers.chaos import STEP_CODE

    exec(STEP_CODE, space)
    digests = set()
    for world in (1, 2, 3):
        model, opt = space["make_model"]()
        for step in range(5):
            sums = [space["local_sum"](model, step, r, world)[0] for r in range(world)]
            space["apply_sum"](model, opt, torch.stack(sums).sum(0))
        digests.add(space["digest"](model))
    assert digests == {reference(5)}
    assert reference(4) != reference(5)


@pytest.mark.parametrize("heal", [False, True], ids=["elastic", "heal"])
def test_a_job_recovers_from_every_kind_of_fault_and_ends_with_the_uninterrupted_weights(ssh_hosts, tmp_path, heal):
    """Elastic (--nodes 2:3): every kind of fault. --heal (--nodes 3): a rank killed, a rank frozen, a slow host."""
    os.chmod(tmp_path, 0o755)  # the ranks read the end file's folder
    said: list[str] = []
    kinds = HEAL_KINDS if heal else KINDS
    soak = Soak(ssh_hosts, tmp_path, seed=5, kinds=kinds, cycle=True, slow_s=8.0, heal=heal, say=said.append)
    try:
        job = soak.run(minutes=10, max_events=len(kinds))  # the kinds in turn, one each
    finally:
        left = soak.leftovers()
    report = "\n".join(said) + f"\n{soak.job}"
    assert [e["kind"] for e in soak.events] == list(kinds), report
    assert all(e["recovered"] for e in soak.events), report
    for ev in soak.events:
        if ev["kind"] != "slow" and not ev.get("rode_out"):
            assert ev["steps_lost"] is not None and ev["steps_lost"] <= 1, report  # a checkpoint every step
        if ev["kind"] != "slow" and not ev.get("rode_out"):
            assert 0 <= ev["detected_s"] <= ev["back_s"], report  # when the loss was found is recorded
    assert job["state"] == "succeeded", report
    assert job["same_weights"] and job["equals_reference"] and job["no_step_skipped"], report
    assert not left, f"left on the hosts: {left}\n{report}"
