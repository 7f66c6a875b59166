"""The warm start as a stage of the fit: a fresh run's supervised steps (``policy.warm_start``), run by
``RLModule.on_fit_start`` once the policy is on its device, before the step-0 validation and the first RL step."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.lightning.lightning_callbacks import restart_weight_averages
from lit_gspo.rl.warm_start import warm_start


def supervised_warm_start(module) -> None:
    """``policy.warm_start.steps`` teacher-forced steps on the training rows' demonstrations; the reference policy is
    then the warm-started one (the policy RL starts from), and so is a weight average's start."""
    cfg = module.settings.warm_start
    if cfg.steps <= 0:
        return
    loss = warm_start(
        module.policy,
        module.tokenizer,
        module.trainer.datamodule.train_rows,
        lambda rows: module.collector.encode(module.policy, rows),
        cfg,
        module.seed,
        environment=module.collector.environment,
        end_id=module.collector.stop_ids[0] if module.collector.stop_ids else None,
        stop=module.collector.stop_strings,
    )
    rank_zero_info(f"warm start: {cfg.steps} supervised steps, last loss {loss:.4f}")
    if module.ref_policy is not None:
        module.ref_policy.load_state_dict(module.policy.state_dict())
    restart_weight_averages(module)
