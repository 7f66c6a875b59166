"""lit_gspo: reinforcement learning of language models on PyTorch Lightning, with pluggable objectives.

The Python API — the same pieces the YAML/CLI names by class::

    import lightning as L
    from lit_gspo import GSPO, CharAccuracy, Generation, Policy, PromptDataModule, RLModule

    model = RLModule(policy=Policy("tiny-llama"), objective=GSPO(), rewards=[CharAccuracy()],
                     generation=Generation(num_generations=8, max_new_tokens=6))
    data = PromptDataModule(train_source="reversal", prompts_per_step=16)
    L.Trainer(max_steps=100, accelerator="cpu", callbacks=[RLProgressBar()]).fit(model, datamodule=data)

``examples/python_api.py`` runs it end to end. Every name below is imported on first use (PEP 562):
``import lit_gspo`` happens whenever any module of the package is imported, and ``rl/``, ``models/``, ``data/`` and
``runtime/`` import no Lightning (``tests/test_architecture.py``), so nothing heavy may be imported here eagerly.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS = {
    # the Lightning pieces
    "RLModule": "lit_gspo.lightning.module",
    "PromptDataModule": "lit_gspo.lightning.datamodule",
    "RowBatches": "lit_gspo.lightning.datamodule",  # rows in batches for trainer.validate/test/predict, whole on every rank
    "RLProgressBar": "lit_gspo.lightning.progress",
    "RunCSVLogger": "lit_gspo.lightning.metrics_file",  # RunCSVLogger(root, resume=True): a resume continues the metrics.csv
    "push_export": "lit_gspo.models.push",
    "cli_main": "lit_gspo.lightning.cli",
    # what one RL step samples and how it updates
    "Policy": "lit_gspo.rl.config",
    "Generation": "lit_gspo.rl.config",
    "Update": "lit_gspo.rl.config",
    "WarmStart": "lit_gspo.rl.config",
    "LoRA": "lit_gspo.rl.config",
    "Validation": "lit_gspo.rl.config",
    "Routing": "lit_gspo.rl.config",
    # rollout-mismatch correction (model.update.mismatch)
    "Mismatch": "lit_gspo.rl.learn.mismatch",
    "TIS": "lit_gspo.rl.learn.mismatch",
    "MIS": "lit_gspo.rl.learn.mismatch",
    "SequenceMIS": "lit_gspo.rl.learn.mismatch",
    "SequenceTIS": "lit_gspo.rl.learn.mismatch",
    "OPSM": "lit_gspo.rl.learn.mismatch",
    # objectives
    "Objective": "lit_gspo.rl.objectives",
    "get_objective": "lit_gspo.rl.objectives",
    "PPO": "lit_gspo.rl.objectives",
    "GRPO": "lit_gspo.rl.objectives",
    "DAPO": "lit_gspo.rl.objectives",
    "GSPO": "lit_gspo.rl.objectives",
    "GSPOToken": "lit_gspo.rl.objectives",
    "DrGRPO": "lit_gspo.rl.objectives",
    "CISPO": "lit_gspo.rl.objectives",
    "GMPO": "lit_gspo.rl.objectives",
    "SAPO": "lit_gspo.rl.objectives",
    "DPPO": "lit_gspo.rl.objectives",
    "ClipCov": "lit_gspo.rl.objectives",
    "KLCov": "lit_gspo.rl.objectives",
    "VESPO": "lit_gspo.rl.objectives",
    "LUSPO": "lit_gspo.rl.objectives",
    # engines and environments
    "RolloutEngine": "lit_gspo.rl.engines",
    "HFGenerate": "lit_gspo.rl.engines",
    "LeanSampler": "lit_gspo.rl.engines",
    "StaticCacheSampler": "lit_gspo.rl.engines",
    "Environment": "lit_gspo.rl.envs",
    "SingleTurn": "lit_gspo.rl.envs",
    "ToolUse": "lit_gspo.rl.envs",
    # advantage estimators
    "AdvantageEstimator": "lit_gspo.rl.advantages",
    "GroupNormalized": "lit_gspo.rl.advantages",
    "GDPO": "lit_gspo.rl.advantages",
    "TurnGroupNormalized": "lit_gspo.rl.advantages",
    "GroupMean": "lit_gspo.rl.advantages",
    "BatchNormalized": "lit_gspo.rl.advantages",
    "RLOO": "lit_gspo.rl.advantages",
    "GAE": "lit_gspo.rl.advantages",
    # rewards
    "RewardSet": "lit_gspo.rl.rewards",
    "CharAccuracy": "lit_gspo.rl.rewards",
    "ExactMatch": "lit_gspo.rl.rewards",
    "AnswerMatch": "lit_gspo.rl.rewards",
    "FormatReward": "lit_gspo.rl.rewards",
    "OverlongPenalty": "lit_gspo.rl.rewards",
    "RewardModel": "lit_gspo.rl.rewards",
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
