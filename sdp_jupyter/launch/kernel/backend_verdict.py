"""The launcher's half of the backend check (the rank's half: launch/rank/backend_check.py): read
each rank's "backend" record of the last attempt and turn them into the job's end status,
`backend_used`, `collectives` and `warnings` (a script that chose another backend, ranks that
trained independently). Called by the run of every agent-run target (launch/kernel/agent_run/run.py) when a job ends.
"""
from __future__ import annotations

from sdp_jupyter.launch.rank.backend_check import KIND, OPTION

def read_records(job_dir) -> dict[int, dict]:
    """Each rank's last "backend" record of the last attempt, from metrics/rank-*.jsonl."""
    from sdp_jupyter import jobdir

    found: list[dict] = []
    for path in jobdir.metrics_paths(job_dir, ranks_only=True):
        for line in jobdir.JsonLinesTail(path).drain(final=True):
            if b'"kind":"backend"' not in line:
                continue
            row = jobdir.parse_record(line)
            if row is not None and row.get("kind") == KIND and isinstance(row.get("rank"), int):
                found.append(row)
    if not found:
        return {}
    last = max(int(r.get("attempt") or 0) for r in found)
    return {r["rank"]: r for r in found if int(r.get("attempt") or 0) == last}


def verdict(job_dir, asked: str, world_size: int, state: str = "succeeded") -> dict:
    """Status fields for a job that has ended in `state`: `backend_used` (the default group's backend
    the ranks made; None when none made one), `collectives` (the fewest any rank ran after set-up;
    None when not counted) and `warnings`. Empty when no rank reported (a SageMaker job, ranks killed).
    Only a job that succeeded is said to have trained independently (a failed one has its error)."""
    try:
        records = read_records(job_dir)
    except Exception:  # noqa: BLE001
        return {}
    if not records:
        return {}
    used = sorted({str(r["backend"]) for r in records.values() if r.get("backend")})
    counts = [r.get("collectives") for r in records.values()]
    complete = len(records) >= world_size
    known = complete and all(isinstance(c, int) for c in counts)
    warnings = []
    other = [b for b in used if b != asked]
    if other:
        warnings.append(
            f"the ranks created a {' and a '.join(other)} process group, not {asked} as asked (--backend {asked}): "
            f"the script or a library it calls (Hugging Face Trainer, accelerate) chose the backend itself. "
            f"Fix: {OPTION} (the launcher makes the default group with --backend before the script), or "
            f"init_process_group(os.environ['SDP_BACKEND']) in the script, or --backend {other[0]}")
    if state == "succeeded" and world_size > 1 and known and all(c == 0 for c in counts):
        if used or any(r.get("engine") for r in records.values()):
            groups = " and ".join(f"a {b}" for b in used) or "an engine"
            what = (f"the {world_size} ranks created {groups} group but never ran a collective on it after "
                    f"set-up, so nothing was averaged. Trainer and accelerate on CPU use the group only with "
                    f"use_cpu=True / Accelerator(cpu=True) (docs/integrations.md)")
        else:
            what = (f"none of the {world_size} ranks created a process group or ran a collective. Fix: "
                    f"init_process_group in the script, or {OPTION}; Trainer and accelerate on CPU also need "
                    f"use_cpu=True / Accelerator(cpu=True) (docs/integrations.md)")
        warnings.append(f"the ranks trained independently: {what}")
    elif (state == "succeeded" and world_size > 1 and complete
          and all(r.get("group_size") == 1 for r in records.values())):
        warnings.append(
            f"the ranks trained independently: each of the {world_size} ranks made a process group of its own "
            f"(world size 1), so nothing was averaged. Fix: init_process_group without world_size and rank "
            f"(they come from WORLD_SIZE and RANK), or {OPTION}")
    return {"backend_used": ", ".join(used) if used else None,
            "collectives": min(counts) if known else None,
            "warnings": warnings}
