"""Rollout engines: what samples the completions (``--model.engine HFGenerate``, ``LeanSampler``, ``VLLMEngine``
(needs the ``vllm`` extra), or your class path)."""

from lit_gspo.engines.base import RolloutEngine
from lit_gspo.engines.hf import HFGenerate
from lit_gspo.engines.lean import LeanSampler
from lit_gspo.engines.vllm import VLLMEngine

__all__ = ["HFGenerate", "LeanSampler", "RolloutEngine", "VLLMEngine"]
