"""One small example of each pluggable stage, in a user's own file (not in the package).

    PYTHONPATH=examples lit-gspo fit --config configs/quickstart.yaml \
        --model.objective plugins.REINFORCE --model.rewards '[plugins.exact_answer, lit_gspo.rl.rewards.CharAccuracy]' \
        --model.environment plugins.Prefixed --model.environment.prefix 'rev? ' --model.engine plugins.CountingEngine

tests/test_plugins.py runs exactly these.
"""

from __future__ import annotations

from torch import Tensor

from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.envs import SingleTurn
from lit_gspo.rl.objectives import Counts, LossOutput, Objective, aggregate, masked_mean


class REINFORCE(Objective, register=False):
    """Plain policy gradient, no ratio and no clip:  ℓ_t = −Â_t · logp_t,  loss = aggregate(ℓ) (token-mean)."""

    zero_advantage_has_no_gradient = True  # ℓ is a multiple of Â

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
        loss = -advantages * logprobs  # (B, T)
        return LossOutput(
            aggregate(loss, mask, self.aggregation, counts), {"clip_frac": masked_mean(mask.float() * 0, mask)}
        )  # nothing is ever clipped


def exact_answer(completions, answer, **kwargs):
    """A reward in TRL's keyword style: 1 when the reply is exactly the answer."""
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]


class Prefixed(SingleTurn):
    """The row's prompt with a prefix in front: an environment decides what the policy sees."""

    def __init__(self, prefix: str = "", **kwargs):
        super().__init__(**kwargs)
        self.prefix = prefix

    def prompt(self, row: dict) -> str:
        return self.prefix + row["prompt"]


class CountingEngine(HFGenerate):
    """transformers' generate, counting the prompts it was given and the completion tokens it sampled."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prompts = self.tokens = 0

    def sample(self, policy, prompt_ids, **kwargs):
        batch = super().sample(policy, prompt_ids, **kwargs)
        self.prompts += len(prompt_ids)
        self.tokens += int(batch.completion_mask.sum())
        return batch
