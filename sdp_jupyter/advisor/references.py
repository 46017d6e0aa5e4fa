"""SageMaker's reference configurations (GPT-2 10B, 30B and 60B on ml.p4d.24xlarge) as advisor
inputs: what notebook 05 and the tests check the advisor against (docs/model_parallel.md)."""
from __future__ import annotations

from dataclasses import dataclass

from sdp_jupyter.advisor.inputs import Cluster, ModelShape, Workload
from sdp_jupyter.parallel_config import ParallelConfig

# SageMaker's reference configurations (GPT-2 shape, sequence 512, vocabulary 50k, ml.p4d.24xlarge:
# 8 x A100 40 GB). The seed gives sizes, not shapes: these shapes are ours (head dim 128, ffn 4h,
# vocabulary 50257 padded to 50304 so that tp divides it), chosen to land on the named sizes.


@dataclass(frozen=True)
class Reference:
    name: str
    workload: Workload
    nodes: int
    config: ParallelConfig
    instance_type: str = "ml.p4d.24xlarge"

    def cluster(self) -> Cluster:
        try:
            return Cluster.from_instance(self.instance_type, self.nodes)
        except Exception:  # catalogue not importable: the seed's figures
            return Cluster(8, 40.0, self.nodes, self.instance_type)


def _gpt(name, layers, hidden):
    return ModelShape(layers=layers, hidden=hidden, heads=hidden // 128, vocab=50304, name=name)


REFERENCES = (
    Reference("GPT-2 10B", Workload(_gpt("10B", 32, 5120), seq_len=512, batch=40, precision="fp16"),
              16, ParallelConfig(tp=4, sharding="optimizer", checkpointing="layer")),
    Reference("GPT-2 30B", Workload(_gpt("30B", 48, 7168), seq_len=512, batch=32, precision="fp16"),
              16, ParallelConfig(tp=8, sharding="optimizer", checkpointing="layer")),
    Reference("GPT-2 60B", Workload(_gpt("60B", 74, 8192), seq_len=512, batch=56, precision="fp16"),
              32, ParallelConfig(tp=8, pp=2, microbatches=4, active_microbatches=2,
                                 sharding="optimizer", checkpointing="layer", schedule="gpipe")),
)

