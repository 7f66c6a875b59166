"""Rollout engines: what samples the completions (``--model.engine HFGenerate``, ``LeanSampler``, ``VLLMEngine``
(needs the ``vllm`` extra), or your class path)."""

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.hf import HFGenerate
from lit_gspo.rl.engines.lean import LeanSampler
from lit_gspo.rl.engines.vllm import VLLMEngine

__all__ = ["HFGenerate", "LeanSampler", "RolloutEngine", "VLLMEngine"]
