"""Tensor parallelism on torch.distributed: a converted model split by heads and
intermediate widths across N ranks (gloo on the CPU, hccl on an NPU).

``shard`` decides and applies the split from the model's structure, ``weights`` reads each
rank's slices of a safetensors checkpoint, ``group`` is the process group and its timed
collectives, ``launch`` starts the ranks and drives them from rank 0.
"""

from kvskill.runtime.distributed.launch import LoadSpec, RankFailedError, TensorParallel
from kvskill.runtime.distributed.shard import ShardPlan, apply_shards, check_tp_size, plan_shards

__all__ = [
    "LoadSpec",
    "RankFailedError",
    "ShardPlan",
    "TensorParallel",
    "apply_shards",
    "check_tp_size",
    "plan_shards",
]
