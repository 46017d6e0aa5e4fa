"""Hybrid parallelism for a training script, from torch's own pieces.

A job started with ``SDP_TP``/``SDP_PP``/... in its environment (see docs/model_parallel.md) calls::

    from sdp_jupyter import parallel
    hp = parallel.setup()                      # process group + DeviceMesh (pp, dp, tp) from the env
    model = parallel.gpt.GPT(cfg)              # or any model with the same layout (see below)
    stage = hp.parallelize(model)              # tp, checkpointing, offload, sharding, pipeline split
    opt = hp.optimizer(stage.parameters(), torch.optim.AdamW, lr=1e-3)
    loss = hp.step(stage, inputs, targets, lm_loss)   # forward + backward (pipelined when pp > 1)
    hp.finish_gradients(stage); opt.step(); opt.zero_grad()

The pieces, each usable alone:

* tensor parallelism: ``torch.distributed.tensor.parallel`` (ColwiseParallel for wq/wk/wv and fc,
  RowwiseParallel for wo and proj, SequenceParallel for the layer norms when sequence parallelism is
  on) over the ``tp`` mesh dimension, which holds consecutive ranks (one node);
* pipeline parallelism: ``torch.distributed.pipelining`` (PipelineStage, ScheduleGPipe,
  Schedule1F1B, ScheduleInterleaved1F1B with ``virtual_stages`` chunks per rank) over ``pp``, the
  outermost dimension (across nodes);
* sharding over ``dp``: ``"optimizer"`` with ``ZeroRedundancyOptimizer`` (ZeRO-1, SageMaker's
  shard_optimizer_state), ``"gradients"``/``"full"`` with FSDP2 ``fully_shard``
  (reshard_after_forward False / True);
* activation checkpointing: ``checkpoint_wrapper`` per block (``"layer"``), or per block with
  torch's selective checkpoint policy that keeps matmul outputs (``"selective"``);
* activation offloading: ``offload_saved_tensors`` (a saved-tensor hook that also handles DTensors,
  which ``torch.autograd.graph.save_on_cpu`` cannot: it keeps a DTensor's local shard on the CPU and
  rebuilds the DTensor on unpack);
* plain data parallelism over ``dp`` (no sharding): ``finish_gradients`` averages gradients over the
  dp group of the default backend (our ``smddp`` engine when the job initialised with it).

The model layout these helpers expect (``sdp_jupyter.parallel.gpt.GPT`` has it): blocks in
``model.layers`` (a ModuleDict keyed by global index), optional ``tok_emb``/``pos_emb`` before them
and ``ln_f``/``head`` after them, a ``forward`` that skips the parts that are ``None``.
"""
from __future__ import annotations

from sdp_jupyter.parallel_config import ParallelConfig
from sdp_jupyter.parallel.data import average_gradients
from sdp_jupyter.parallel.hybrid import Hybrid, build_mesh, setup
from sdp_jupyter.parallel.memory import OffloadStats, apply_checkpointing, offload_saved_tensors
from sdp_jupyter.parallel.pipeline import split_for_pipeline, stage_layers
from sdp_jupyter.parallel.tensor import apply_tensor_parallel, tp_plan_for_block

__all__ = ["ParallelConfig", "Hybrid", "setup", "apply_tensor_parallel", "apply_checkpointing",
           "offload_saved_tensors", "OffloadStats", "split_for_pipeline", "stage_layers",
           "average_gradients", "build_mesh", "tp_plan_for_block"]

from sdp_jupyter.parallel import gpt  # noqa: E402,F401  (parallel.gpt without a second import)
