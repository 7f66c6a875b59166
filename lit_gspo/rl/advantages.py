"""Advantage estimators: a rollout's rewards (and, for GAE, the critic's values) → Â, in fp32.

Rows are ordered group-major: prompt 0's G completions, then prompt 1's, and so on.

    GroupNormalized  "group"       Â_i = (R_i − mean_g R) / (std_g R + eps)      GRPO, DAPO, GSPO (std unbiased)
    GroupMean        "group_mean"  Â_i = R_i − mean_g R                          Dr. GRPO (no std division)
    BatchNormalized  "batch"       Â_i = (R_i − mean_g R) / (std_batch R + eps)  group baseline, batch-wide scale
    GDPO             "gdpo"        Â_i = whiten_batch(Σ_k w_k group-normalised r_k)  GDPO: each reward function first
    RLOO             "rloo"        Â_i = R_i − (Σ_g R − R_i) / (G − 1)           leave-one-out baseline
    GAE              "gae"         generalised advantage estimation on a critic's values, whitened (PPO)
    TurnGroupNormalized "turn_group"  per reply of a multi-turn episode: its return-to-go, group-normalised per turn

Batch-wide statistics (``batch``'s std, GDPO's and GAE's whitening) are over every rank's rows: under DDP or FSDP2 the
batch is the global one, and every rank must call the estimator (it is a collective there).

Each is a small class picked by class path or name (``--model.advantage RLOO``); :func:`get_advantage`
builds one by name. An estimator returns Â per row (N,) or per token (N, T); one that needs the
critic's values (``needs_values``) reads ``rollout.old_values`` and also fills ``rollout.returns``.
A group whose rewards are all equal carries no signal: its advantages are exactly 0, never NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import Tensor

from lit_gspo.runtime.collectives import mean_and_std, sum_over_ranks
from lit_gspo.runtime.registry import Registered

if TYPE_CHECKING:
    from lit_gspo.rl.rollout import RolloutBatch

ADVANTAGES: dict[str, type[AdvantageEstimator]] = {}


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """(N,) → (N / G, G) in fp32, validating the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"the number of rewards N={rewards.numel()} must be a positive multiple of group_size={group_size}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    return rewards.float().reshape(-1, group_size)


def _zero_constant_groups(adv: Tensor, grouped: Tensor) -> Tensor:
    """Advantages of all-equal groups set exactly to 0 (floating means are not exact)."""
    constant = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)  # (N/G, 1)
    return torch.where(constant, torch.zeros_like(adv), adv).reshape(-1)


def group_advantages(
    rewards: Tensor, group_size: int, scale: Literal["group", "batch", "none"] = "group", eps: float = 1e-6
) -> Tensor:
    """(R − group mean) / (std + eps), std of the group (``group``), of the batch (``batch``) or 1 (``none``)."""
    grouped = _grouped(rewards, group_size)  # (N/G, G)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale == "group":
        std = grouped.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        adv = centred / (std + eps)
    elif scale == "batch":  # over every rank's rewards: the batch is the global one
        adv = centred / (mean_and_std(grouped)[1] + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown scale {scale!r}; valid: group, batch, none")
    return _zero_constant_groups(adv, grouped)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: Â_i = R_i − mean of the other G − 1 rewards of its group."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    grouped = _grouped(rewards, group_size)  # (N/G, G)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return _zero_constant_groups(grouped - baseline, grouped)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid (right-padded) tokens of each row.

        δ_t = r_t + γ V_{t+1} m_{t+1} − V_t,   Â_t = δ_t + γ λ m_{t+1} Â_{t+1},   returns = Â + V
    Shapes (B, T); outputs are 0 on padding (rows may be all padding). Values after the last valid
    token count as 0 (the episode ends there).
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must share a (B, T) shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(m, rewards.float(), zero)  # (B, T)
    v = torch.where(m, values.float(), zero)  # (B, T)
    mf = m.float()
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])  # (B,)
    for t in reversed(range(r.shape[1])):
        next_m = mf[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
        next_v = v[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
        delta = r[:, t] + gamma * next_v * next_m - v[:, t]
        last = (delta + gamma * lam * next_m * last) * mf[:, t]
        adv[:, t] = last
    return adv, torch.where(m, adv + v, zero)


class AdvantageEstimator(Registered, register=False):
    """Base class: ``estimator(rollout, group_size)`` → Â, (N,) per row or (N, T) per completion token.

    Subclasses register under ``name`` (default: the class name in snake_case; picked in YAML by class name or
    path; a name another class holds is refused). ``needs_values``: the
    estimator reads the critic's ``rollout.old_values`` (the trainer then needs an objective with a critic).
    ``needs_groups``: the estimator compares the G completions of a prompt with each other, so G = 1
    gives Â = 0 everywhere (the trainer then refuses ``num_generations`` < 2). False by default, so a
    user's estimator is not refused for G = 1 unless it says so.
    """

    registry, kind = ADVANTAGES, "advantage estimator"
    name: ClassVar[str] = "advantage"
    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = False

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GroupBaseline(AdvantageEstimator, register=False):
    """Â_i = (R_i − mean_g R) / scale: the group's mean reward as baseline, ``scale`` as :func:`group_advantages`."""

    scale: ClassVar[str] = "group"
    needs_groups = True

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        return group_advantages(rollout.rewards, group_size, scale=self.scale)


class GroupNormalized(GroupBaseline):
    """Â_i = (R_i − mean_g R) / (std_g R + eps): GRPO's group-relative advantage."""

    name, scale = "group", "group"


class GroupMean(GroupBaseline):
    """Â_i = R_i − mean_g R: Dr. GRPO's advantage, no std division."""

    name, scale = "group_mean", "none"


class BatchNormalized(GroupBaseline):
    """Â_i = (R_i − mean_g R) / (std_batch R + eps): group baseline, one scale for the batch."""

    name, scale = "batch", "batch"


class GDPO(AdvantageEstimator):
    """Â_i = (R'_i − mean R') / (std R' + eps) over the batch, R' the sum of the reward functions' scores each normalised
    within its group (``rollout.decoupled_rewards``, lit_gspo/rl/rewards/decoupled.py): GDPO (group reward-decoupled
    normalisation), TRL's ``multi_objective_aggregation: normalize_then_sum``. std Bessel-corrected, eps 1e-4 (TRL's).
    ``train/reward`` stays the weighted sum of the raw scores; an environment's turn rewards are not in R'."""

    name = "gdpo"
    needs_groups = True

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        if rollout.decoupled_rewards is None:
            raise ValueError(
                "GDPO reads each reward function's scores normalised within the group (rollout.decoupled_rewards), "
                "which the collector sets on every rollout it samples; this rollout has none"
            )
        grouped = _grouped(rollout.decoupled_rewards, group_size)
        mean, std = mean_and_std(grouped)  # over every rank's rows
        return _zero_constant_groups((grouped - mean) / (std + 1e-4), grouped)


class RLOO(AdvantageEstimator):
    """Â_i = R_i − mean of the other G − 1 rewards of its group (REINFORCE leave-one-out)."""

    name = "rloo"
    needs_groups = True

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        return rloo_advantages(rollout.rewards, group_size)


class GAE(AdvantageEstimator):
    """Per-token GAE on the critic's values; the reward sits on each row's last completion token.

        Â = gae(r, V_old, mask; γ, λ),  returns = Â + V_old,  then Â ← (Â − mean Â) / (std Â + 1e-8)
    whitened over the batch's valid tokens, as PPO does (``whiten``). Fills ``rollout.returns``.
    """

    name = "gae"
    needs_values = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
        if not (0 <= gamma <= 1 and 0 <= lam <= 1):
            raise ValueError(f"GAE needs 0 <= gamma <= 1 and 0 <= lam <= 1, got gamma={gamma}, lam={lam}")
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __repr__(self) -> str:
        return f"GAE(gamma={self.gamma}, lam={self.lam}, whiten={self.whiten})"

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        values, mask = rollout.old_values, rollout.completion_mask
        if values is None:
            raise ValueError("GAE needs the critic's values (rollout.old_values): use an objective with a critic (PPO)")
        if rollout.token_rewards is None:  # single-turn: the reward sits on the last completion token
            token_rewards = torch.zeros_like(values)
            last = (mask.sum(1) - 1).clamp(min=0)
            token_rewards[torch.arange(len(rollout)), last] = rollout.rewards
            advantages, rollout.returns = gae(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)
        else:  # multi-turn: the environment's tokens are skipped, as if the replies were one sequence
            index, packed_mask = pack_policy_tokens(mask)
            packed = gae(
                rollout.token_rewards.gather(1, index),
                values.gather(1, index),
                packed_mask,
                gamma=self.gamma,
                lam=self.lam,
            )
            advantages, rollout.returns = (torch.zeros_like(values).scatter(1, index, x * packed_mask) for x in packed)
        if self.whiten:  # over every rank's valid tokens
            valid = advantages[mask]
            if sum_over_ranks(valid.numel()) > 1:
                mean, std = mean_and_std(valid)
                advantages = (advantages - mean) / (std + 1e-8)
        return advantages * mask


def pack_policy_tokens(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index, packed_mask): ``x.gather(1, index)`` moves each row's masked tokens to its front, in order."""
    order = torch.sort((~mask.bool()).to(torch.int8), dim=1, stable=True).indices  # masked positions first
    width = max(1, int(mask.sum(1).max()))
    index = order[:, :width]
    return index, torch.arange(width, device=mask.device)[None] < mask.sum(1, keepdim=True)


class TurnGroupNormalized(AdvantageEstimator):
    """Per-turn credit for multi-turn episodes: each reply's tokens get that reply's return-to-go,
    normalised within its group among the episodes that have a reply at the same turn.

        G_{i,k} = Σ_{j ≥ k} γ^{j−k} r_{i,j}    r_{i,j}: reply j's reward (the last reply's includes the reward functions')
        Â_{i,t} = (G_{i,k} − mean G_{·,k}) / (std G_{·,k} + eps)    for every token t of reply k of episode i
    mean and std over the episodes of i's group with a reply k (std unbiased); Â = 0 where fewer than two
    have one, or their returns are equal. γ = 1 (default): a reply is credited with everything that
    followed it; γ = 0: with its own reward only (each turn a bandit of its own). Single-turn rollouts (one reply per episode) get exactly
    GroupNormalized's Â. GSPO-token uses Â_{i,t} per token; GSPO and the token-level objectives too
    (see the README's table).
    """

    name = "turn_group"
    needs_groups = True

    def __init__(self, gamma: float = 1.0, eps: float = 1e-6):
        if not 0 <= gamma <= 1:
            raise ValueError(f"TurnGroupNormalized needs 0 <= gamma <= 1, got {gamma}")
        self.gamma, self.eps = gamma, eps

    def __repr__(self) -> str:
        return f"TurnGroupNormalized(gamma={self.gamma}, eps={self.eps})"

    def __call__(self, rollout: RolloutBatch, group_size: int) -> Tensor:
        if rollout.turn_ids is None:
            return group_advantages(rollout.rewards, group_size, eps=self.eps)
        _grouped(rollout.rewards, group_size)  # validates the layout and that rewards are finite
        mask, turn_ids = rollout.completion_mask, rollout.turn_ids
        turns = int(turn_ids[mask].max()) + 1 if mask.any() else 1
        rewards = torch.zeros(len(rollout), turns, dtype=torch.float32, device=mask.device)
        rewards.scatter_add_(1, turn_ids.clamp(max=turns - 1), torch.where(mask, rollout.token_rewards.float(), 0.0))
        present = (
            torch.zeros_like(rewards, dtype=torch.long).scatter_add_(1, turn_ids.clamp(max=turns - 1), mask.long()) > 0
        )
        returns = rewards.clone()  # (N, K) return-to-go of each reply
        for k in reversed(range(turns - 1)):
            returns[:, k] += self.gamma * returns[:, k + 1]
        g_returns, g_present = returns.view(-1, group_size, turns), present.view(-1, group_size, turns)
        n = g_present.sum(1, keepdim=True)  # (N/G, 1, K) episodes with a reply k
        mean = (g_returns * g_present).sum(1, keepdim=True) / n.clamp(min=1)
        var = (((g_returns - mean) * g_present) ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
        highest = torch.where(g_present, g_returns, -torch.inf).amax(1, keepdim=True)
        lowest = torch.where(g_present, g_returns, torch.inf).amin(1, keepdim=True)
        signal = g_present & (n >= 2) & (highest != lowest)
        adv = torch.where(signal, (g_returns - mean) / (var.sqrt() + self.eps), 0.0).view(-1, turns)
        return adv.gather(1, turn_ids.clamp(max=turns - 1)) * mask


def get_advantage(name: str, **kwargs) -> AdvantageEstimator:
    """Build a registered estimator by name (``group``, ``group_mean``, ``batch``, ``rloo``, ``gae``) or class name."""
    by_class = {cls.__name__: cls for cls in ADVANTAGES.values()}
    cls = ADVANTAGES.get(name) or by_class.get(name)
    if cls is None:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGES)} "
            f"(or the class names {', '.join(by_class)})"
        )
    return cls(**kwargs)
