"""Rollout engines: what samples the completions (``--model.engine HFGenerate``, ``LeanSampler``,
``StaticCacheSampler``, ``VLLMEngine`` (needs the ``vllm`` extra), or your class path)."""

import torch

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.hf import HFGenerate
from lit_gspo.rl.engines.lean import LeanSampler
from lit_gspo.rl.engines.static_cache import StaticCacheSampler
from lit_gspo.rl.engines.vllm import VLLMEngine

__all__ = ["HFGenerate", "LeanSampler", "RolloutEngine", "StaticCacheSampler", "VLLMEngine", "default_engine"]


def default_engine(device: torch.device | str, sharded: bool = False) -> RolloutEngine:
    """The engine when none is given: :class:`StaticCacheSampler` for a policy on CUDA, :class:`HFGenerate` elsewhere
    and under sharded parameters (FSDP2 over several processes: ``generate``'s loop keeps the ranks in step)."""
    return StaticCacheSampler() if torch.device(device).type == "cuda" and not sharded else HFGenerate()
