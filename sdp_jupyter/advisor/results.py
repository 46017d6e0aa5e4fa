"""The advisor's outputs: a memory term, a rule's finding, a pipeline stage's memory and the
estimate of a whole configuration (its peak stage, its budget, its verdict and a table for people).
"""
from __future__ import annotations

from dataclasses import dataclass

from sdp_jupyter.advisor.inputs import DEFAULT_OVERHEAD, GiB, Cluster, Workload
from sdp_jupyter.parallel_config import ParallelConfig


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    how: str  # the formula with its numbers
    #: "" for memory held through the whole backward; terms of a named phase are only live in that
    #: phase ("loss": the logits and their gradient, freed before "recompute": the one layer
    #: per-layer checkpointing rebuilds), so a stage's peak counts the largest phase only
    phase: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GiB


@dataclass(frozen=True)
class Finding:
    level: str  # "error" (will not run), "warning" (runs badly), "info"
    knob: str
    message: str
    fix: str = ""

    def __str__(self):
        return f"[{self.level}] {self.knob}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    in_flight: float
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        phases: dict[str, float] = {}
        for t in self.terms:
            phases[t.phase] = phases.get(t.phase, 0.0) + t.bytes
        held = phases.pop("", 0.0)
        return held + max(phases.values(), default=0.0)

    def term(self, name: str) -> float:
        return sum(t.bytes for t in self.terms if t.name == name)


@dataclass(frozen=True)
class Estimate:
    workload: Workload
    cluster: Cluster
    config: ParallelConfig
    stages: tuple[StageMemory, ...]
    findings: tuple[Finding, ...]
    headroom: float
    bubble: float
    overhead: float = DEFAULT_OVERHEAD

    @property
    def dp(self) -> int:
        return max(1, self.cluster.world_size // (self.config.tp * self.config.pp))

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak(self) -> float:
        return self.peak_stage.total

    @property
    def peak_gib(self) -> float:
        return self.peak / GiB

    @property
    def budget(self) -> float:
        return self.headroom * self.cluster.gpu_memory_gib * GiB

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    @property
    def ok(self) -> bool:
        return self.valid and self.fits

    @property
    def global_batch(self) -> int:
        return self.workload.replica_batch(self.config.tp) * self.dp

    def terms(self) -> tuple[Term, ...]:
        return self.peak_stage.terms

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{self.config.describe()} on {self.cluster.describe()}: peak {self.peak_gib:.1f} GiB "
                f"(stage {self.peak_stage.stage}) {verdict} in {self.budget / GiB:.1f} GiB "
                f"({self.headroom:.0%} of {self.cluster.gpu_memory_gib:g} GiB)")

    def table(self) -> str:
        """The terms of the peak stage, one per line, for people."""
        lines = [self.summary()]
        for t in self.terms():
            phase = f" [{t.phase} phase]" if t.phase else ""
            lines.append(f"  {t.name:<22}{t.gib:8.2f} GiB   {t.how}{phase}")
        if self.config.pp > 1:
            lines.append(f"  pipeline bubble       {self.bubble:8.1%}      (p-1)/(m+p-1)")
        for f in self.findings:
            lines.append(f"  {f}")
        return "\n".join(lines)
