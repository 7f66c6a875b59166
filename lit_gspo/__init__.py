"""lit_gspo: reinforcement learning of language models on PyTorch Lightning, with pluggable objectives.

The Python API — the same pieces the YAML/CLI names by class::

    import lightning as L
    from lit_gspo import GSPO, CharAccuracy, Generation, PromptDataModule, RLModule

    model = RLModule(model="tiny-llama", objective=GSPO(), rewards=[CharAccuracy()],
                     generation=Generation(num_generations=8, max_new_tokens=6))
    data = PromptDataModule(train_source="reversal", prompts_per_step=16)
    L.Trainer(max_steps=100, accelerator="cpu", callbacks=[RLProgressBar()]).fit(model, datamodule=data)

``examples/python_api.py`` runs it end to end. Every name below is imported on first use (PEP 562):
``import lit_gspo`` happens whenever any stage is imported, and the stages below ``module.py`` import
no Lightning (``tests/test_architecture.py``), so nothing heavy may be imported here eagerly.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS = {
    # the Lightning pieces
    "RLModule": "lit_gspo.module",
    "PromptDataModule": "lit_gspo.data",
    "RLProgressBar": "lit_gspo.progress",
    "RunCSVLogger": "lit_gspo.metrics_file",  # RunCSVLogger(root, resume=True): a resume continues the metrics.csv
    "push_export": "lit_gspo.hub",
    "cli_main": "lit_gspo.rlcli",
    # what one RL step samples and how it updates
    "Generation": "lit_gspo.config",
    "Update": "lit_gspo.config",
    "WarmStart": "lit_gspo.config",
    "LoRA": "lit_gspo.config",
    # rollout-mismatch correction (model.mismatch)
    "Mismatch": "lit_gspo.mismatch",
    "TIS": "lit_gspo.mismatch",
    "MIS": "lit_gspo.mismatch",
    "SequenceMIS": "lit_gspo.mismatch",
    "OPSM": "lit_gspo.mismatch",
    # objectives
    "Objective": "lit_gspo.objectives",
    "get_objective": "lit_gspo.objectives",
    "PPO": "lit_gspo.objectives",
    "GRPO": "lit_gspo.objectives",
    "DAPO": "lit_gspo.objectives",
    "GSPO": "lit_gspo.objectives",
    "GSPOToken": "lit_gspo.objectives",
    "DrGRPO": "lit_gspo.objectives",
    "CISPO": "lit_gspo.objectives",
    "GMPO": "lit_gspo.objectives",
    "SAPO": "lit_gspo.objectives",
    "DPPO": "lit_gspo.objectives",
    "ClipCov": "lit_gspo.objectives",
    "KLCov": "lit_gspo.objectives",
    "VESPO": "lit_gspo.objectives",
    "LUSPO": "lit_gspo.objectives",
    # engines and environments
    "RolloutEngine": "lit_gspo.engines",
    "HFGenerate": "lit_gspo.engines",
    "LeanSampler": "lit_gspo.engines",
    "Environment": "lit_gspo.envs",
    "SingleTurn": "lit_gspo.envs",
    "ToolUse": "lit_gspo.envs",
    # advantage estimators
    "AdvantageEstimator": "lit_gspo.advantages",
    "GroupNormalized": "lit_gspo.advantages",
    "TurnGroupNormalized": "lit_gspo.advantages",
    "GroupMean": "lit_gspo.advantages",
    "BatchNormalized": "lit_gspo.advantages",
    "RLOO": "lit_gspo.advantages",
    "GAE": "lit_gspo.advantages",
    # rewards
    "RewardSet": "lit_gspo.rewards",
    "CharAccuracy": "lit_gspo.rewards",
    "ExactMatch": "lit_gspo.rewards",
    "AnswerMatch": "lit_gspo.rewards",
    "FormatReward": "lit_gspo.rewards",
    "OverlongPenalty": "lit_gspo.rewards",
    "RewardModel": "lit_gspo.rewards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'lit_gspo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
