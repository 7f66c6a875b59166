"""The entropy bonus (TRL's ``entropy_coef``): the loss gets −c · H̄, with c constant or adapted to a target entropy.

    H̄ = Σ_{i,t} m_{i,t} H_{i,t} / N,      H_{i,t} = −Σ_v π_θ(v | x_i, y_i,<t) log π_θ(v | x_i, y_i,<t)

m: the tokens the policy gradient acts on; N: how many the minibatch holds over every rank (``Counts.tokens``; with
``top_entropy_quantile`` ρ < 1, whose hook keeps the top ρ of each micro-batch's tokens, ρ · ``Counts.tokens``). One
normaliser for every objective whatever its aggregation, as in TRL, so c means the same for GRPO and GSPO; and H̄ is
the same for any micro-batch split or number of ranks.

Adaptive control (Skywork-OR1, He et al. 2025; TRL's ``use_adaptive_entropy``) with a target H*: after each optimiser
step, H̄ measured on its minibatch over every rank,

    c ← min(c + δ, c_max)   if H̄ ≤ H*,        c ← max(c − δ, c_min)   otherwise,

and a step applies c only while the last measured H̄ ≤ H* (0 before the first measure), as TRL's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.hooks import UpdateHook
from lit_gspo.rl.objectives import Counts
from lit_gspo.rl.objectives.base import masked_sum
from lit_gspo.runtime.collectives import all_reduce_sum


class EntropyBonus(UpdateHook):
    """−c · H̄ added to each micro-batch's loss (:meth:`loss`); with a target, c adapted after each optimiser step."""

    def __init__(
        self,
        coef: float,
        target: float | None = None,
        delta: float = 0.005,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
        kept_share: float = 1.0,
    ):
        self.coef, self.target, self.delta, self.coef_min, self.coef_max = coef, target, delta, coef_min, coef_max
        self.kept_share = kept_share  # of each micro-batch's tokens, those m keeps (top_entropy_quantile)
        self.last_entropy = math.inf  # H̄ of the last optimiser step: none yet
        self.window: Tensor | None = None  # this rank's [Σ m H, Σ m] of the minibatch under way (adaptive)
        self.applied: list[float] = []  # c of each optimiser step of the update under way

    @classmethod
    def of(cls, update: Update) -> EntropyBonus | None:
        """The bonus ``update`` asks for; None where it asks for none (c = 0 and no target)."""
        if update.entropy_coef == 0 and update.entropy_target is None:
            return None
        return cls(
            update.entropy_coef,
            update.entropy_target,
            update.entropy_coef_delta,
            update.entropy_coef_min,
            update.entropy_coef_max,
            update.top_entropy_quantile,
        )

    @property
    def applied_coef(self) -> float:
        """The c this step applies: c, or with a target 0 while the last measured H̄ is above it."""
        if self.target is None or self.last_entropy <= self.target:
            return self.coef
        return 0.0

    def loss(self, entropy: Tensor, mask: Tensor, counts: Counts) -> Tensor:
        """−c · Σ m H / N over one micro-batch (``entropy`` with its graph), its share of the minibatch's bonus."""
        total = masked_sum(entropy, mask)
        if self.target is not None:
            measured = torch.stack([total.detach().double(), mask.sum().double()])
            self.window = measured if self.window is None else self.window + measured
        return total * (-self.applied_coef / max(counts.tokens * self.kept_share, 1.0))

    def before_update(self, update) -> None:
        self.applied = []

    def after_backward(self, update, minibatch) -> None:
        """The minibatch's H̄ over every rank (collective: every rank runs as many minibatches), then c for the next."""
        self.applied.append(self.applied_coef)
        if self.target is None:
            return
        window = self.window if self.window is not None else torch.zeros(2, dtype=torch.float64)
        self.window = None
        entropy_sum, tokens = all_reduce_sum(window).tolist()
        if not tokens:  # no token measured: nothing to adapt to
            return
        self.last_entropy = entropy_sum / tokens
        if self.last_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)

    def metrics(self, update) -> dict[str, float]:
        """``entropy_coef``: c after the update (TRL's); ``entropy_coef_applied``: the mean c its steps applied."""
        applied = sum(self.applied) / len(self.applied) if self.applied else float("nan")
        return {"entropy_coef": self.coef, "entropy_coef_applied": applied}

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
