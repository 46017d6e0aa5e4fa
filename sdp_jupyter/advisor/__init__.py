"""Model-parallel advisor: per-GPU memory of a hybrid-parallel training job, the rules a configuration
must obey, and the cheapest change that makes a model fit.

Pure logic: no torch, no widgets (measure mode, which imports torch, is ``sdp_jupyter.parallel.measure``;
the widget is ``sdp_jupyter.ui.advisor``). Every figure is bytes; ``GiB`` is 2**30 bytes.

The package, one module per concern (the names below are re-exported here, so
``from sdp_jupyter import advisor as A; A.estimate(...)`` is the way to use it):

* inputs: ``ModelShape`` (and ``shape_of`` a torch module), ``Cluster``, ``Workload``, the units;
* results: ``Term``, ``Finding``, ``StageMemory``, ``Estimate`` (its verdict and table);
* memory: the memory model, term by term (``memory_by_stage``, ``in_flight``, ``bubble_fraction``;
  its docstring gives every formula and its source);
* rules: ``validate_layout`` (no model needed: what a launcher checks), ``validate``, ``min_nodes``,
  and ``estimate``, the memory model and the rules together;
* search: ``recommend`` (the cheapest configuration that fits) and ``explain`` (why each knob);
* references: SageMaker's reference configurations (``REFERENCES``).
"""
from __future__ import annotations

from sdp_jupyter.advisor.inputs import (DEFAULT_OVERHEAD, HEADROOM, OPTIMIZERS, PRECISIONS, Cluster, GiB, ModelShape,
                                        Workload, shape_of)
from sdp_jupyter.advisor.memory_model import bubble_fraction, in_flight, memory_by_stage
from sdp_jupyter.advisor.references import REFERENCES, Reference
from sdp_jupyter.advisor.results import Estimate, Finding, StageMemory, Term
from sdp_jupyter.advisor.rules import estimate, min_nodes, validate, validate_layout
from sdp_jupyter.advisor.search import KnobReason, Recommendation, Step, explain, larger_instances, recommend
from sdp_jupyter.parallel_config import CHECKPOINTING, RUNTIMES, SCHEDULES, SHARDING, ParallelConfig

__all__ = ["CHECKPOINTING", "DEFAULT_OVERHEAD", "HEADROOM", "OPTIMIZERS", "PRECISIONS", "REFERENCES", "RUNTIMES",
           "SCHEDULES", "SHARDING", "Cluster", "Estimate", "Finding", "GiB", "KnobReason", "ModelShape",
           "ParallelConfig", "Recommendation", "Reference", "StageMemory", "Step", "Term", "Workload",
           "bubble_fraction", "estimate", "explain", "in_flight", "larger_instances", "memory_by_stage", "min_nodes",
           "recommend", "shape_of", "validate", "validate_layout"]
