"""``trainer.predict(model, datamodule=..., ckpt_path=...)``: completions of prompt rows, drawn as a validation draws
them (``validation.py``: one greedy completion per prompt, or ``validation.num_generations`` sampled at
``validation.temperature``, within ``generation.validation_budget``), each with its reward.

    one prediction per prompt row:  {"row": the row,  "completions": [reply_1 … reply_n],
                                     "rewards": [R_1 … R_n] (None: the reward failed),
                                     "scores": {reward function: [its unweighted score of each reply]}}

``trainer.predict`` returns one list of these per batch. Each rank samples its share of a batch, as in validation,
and every rank gets the whole batch back in its order, so what one process returns does not depend on how many
there are. The reply of a multi-turn episode is its last turn's.
"""

from __future__ import annotations

import math

from lit_gspo.lightning.validation import sample_share
from lit_gspo.rl.evaluate import failed_samples
from lit_gspo.runtime.collectives import gather_objects


def predict_rows(module, rows: list[dict]) -> list[dict]:
    """The predictions of a batch of prompt rows (collective: every rank calls it with the same batch)."""
    drawn = sample_share(module, rows)
    share = [] if drawn is None else _predictions(*drawn[:3], module.collector.last_per_function)
    shares = gather_objects(share)
    world = len(shares)
    return [shares[i % world][i // world] for i in range(len(rows))]  # rank r held rows r, r + world, ...


def _predictions(rows, batch, replies, per_function) -> list[dict]:
    n = len(replies) // len(rows)  # group-major: a prompt's n samples are consecutive
    rewards = [None if failed else reward for reward, failed in zip(batch.rewards.tolist(), failed_samples(batch))]
    scores = {name: [None if math.isnan(s) else s for s in values] for name, values in per_function.items()}
    return [
        {
            "row": row,
            "completions": replies[i * n : (i + 1) * n],
            "rewards": rewards[i * n : (i + 1) * n],
            "scores": {name: values[i * n : (i + 1) * n] for name, values in scores.items()},
        }
        for i, row in enumerate(rows)
    ]
