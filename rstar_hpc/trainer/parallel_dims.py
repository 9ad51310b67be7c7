"""The trainer's parallel layout as numbers: world = tp x pp x dp, vpp model chunks per pipeline rank, and what
the degrees must divide. A value apart from the live world (parallel.py: process groups, the policy in them): the
model builder checks its chunk against it too, and parallel.py builds the policy with that builder, so the rules
sit below both. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from rstar_hpc.trainer.arch import Arch


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of the trainer: world = tp * pp * dp (dp derived); vpp model chunks per pipeline rank; ep
    of the dp ranks split a mixture-of-experts layer's experts (expert tensor parallelism is tp)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(f"WORLD_SIZE={self.world_size} is not a multiple of tensor_parallel_size ({self.tp}) "
                             f"x pipeline_parallel_size ({self.pp}) = {self.tp * self.pp}; change the degrees "
                             f"or the number of trainer ranks")
        if self.vpp is not None and self.pp == 1:
            raise ValueError(f"virtual_pipeline_parallel_size={self.vpp} needs pipeline_parallel_size > 1")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"expert_parallel_size={self.ep} does not divide the data-parallel size {self.dp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def check_model(self, arch: Arch) -> None:
        """Head counts must split evenly over tensor-parallel ranks, layers over pipeline stages."""
        width = ("moe_intermediate_size", arch.moe_intermediate_size) if arch.is_moe else \
            ("intermediate_size", arch.intermediate_size)
        for name, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads), width):
            if n % self.tp:
                raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size={self.tp}; "
                                 f"pick a tensor_parallel_size that divides it")
        if self.ep > 1 and (not arch.is_moe or arch.num_experts % self.ep):
            raise ValueError(f"expert_parallel_size={self.ep} does not divide the model's {arch.num_experts} experts")
        stages = self.pp * (self.vpp or 1)
        if arch.num_layers % stages:
            raise ValueError(f"num_hidden_layers={arch.num_layers} is not divisible by pipeline_parallel_size="
                             f"{self.pp} x virtual_pipeline_parallel_size={self.vpp or 1}; pick degrees that divide it")
