"""Evaluation with the trainer's own sampling and rewards: greedy accuracy, mean@n and pass@k.

    greedy     one greedy completion per prompt (as ``val/reward``):  reward = mean R,  accuracy = share R ≥ τ
    sampled    n completions per prompt at temperature T (``Collector.sample``, G = n):
               mean@n = mean R over all samples;  c_i = #{samples of prompt i with R ≥ τ}
               pass@k = mean_i [1 − C(n − c_i, k) / C(n, k)]   (the unbiased estimator of Chen et al. 2021,
               "Evaluating Large Language Models Trained on Code"; pass@1 = mean_i c_i / n)

Each batch is sampled as ``world_size`` processes validate it (``lit_gspo.lightning.validation.sample_share``):
process r takes prompts r, r + W, ... of every batch, drawing from its own stream, so that a run validated on W
processes is reproduced on one.

A sample whose reward failed (``reward_failed``) counts as not solved; its reward is the one
``Collector.sample`` gives it (its group's mean valid reward), so mean@n is the mean of the valid rewards
per prompt. Pure torch: no Lightning here (``lit_gspo.tools.eval`` is the ``lit-gspo eval`` front end).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lit_gspo.rl.collect import Collector
from lit_gspo.runtime.sample_stats import WEIGHT, merge_stats, without_weights

#: a multi-turn environment's episode statistics that the table shows (the JSON has every statistic)
EPISODE_KEYS = ("turns", "success")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n, c of them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []


def shares(count: int, batch_size: int, world_size: int = 1):
    """``(rank, indices)`` of each process's share of each batch of ``batch_size`` of ``count`` rows, process by
    process: as ``world_size`` processes validate, rank r takes rows r, r + W, ... of every batch."""
    for rank in range(world_size):
        for start in range(0, count, batch_size):
            indices = list(range(start + rank, min(start + batch_size, count), world_size))
            if indices:
                yield rank, indices


def failed_samples(batch) -> torch.Tensor:
    """Samples whose reward failed: ``Collector.sample`` masks their whole completion (a reply has ≥ 1 token)."""
    return ~batch.completion_mask.any(1).cpu()


def _aggregate_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """``Collector.sample``'s stats of several batches as those of all their episodes (``runtime/sample_stats.py``):
    ``reward_failed`` summed, ``rewards/<function>/mean`` over the samples the function scored and its ``/std`` pooled,
    multi-turn ``turns``, ``success``, tool metrics, ... over the episodes, ``success_turn{k}`` over those that reached
    turn k."""
    return without_weights(merge_stats(stats))


class RewardTally:
    """Sums over completed, scored batches: what ``val/reward`` (Lightning's validation loop) and ``lit-gspo eval``'s
    greedy table both report, so the two agree bit for bit.

        reward = Σ R / #samples      response_length = Σ completion tokens / #samples
        <key>  = Σ value·w / Σ w     (w = the samples the batch's value is a mean over: its ``WEIGHT`` key)

    A greedy batch has one sample per prompt, a sampled one n (``validation.num_generations``: reward is mean@n).

    The sums are fp64 and summed over ranks in one collective (:meth:`reduce`), so the result does not depend on how
    the prompts are split over processes or batches.
    """

    def __init__(self, keys: list[str] | tuple[str, ...] = ()) -> None:
        self.keys = list(keys)  # the stats averaged, e.g. clipped_ratio, rewards/<function>/mean, episode metrics
        self.sums = torch.zeros(3 + 2 * len(self.keys), dtype=torch.float64)  # Σ R, samples, tokens, (Σ v·w, Σ w)…

    def add(self, batch, stats: dict[str, float]) -> None:
        samples = batch.rewards.numel()
        self.sums[0] += float(batch.rewards.sum())
        self.sums[1] += samples
        self.sums[2] += float(batch.completion_mask.sum())
        for j, key in enumerate(self.keys):
            weight = stats.get(WEIGHT + key, samples)  # success_turn{k}: the episodes that reached turn k; a
            if key in stats and weight > 0:  # reward function's mean: the replies it scored (none: NaN, weight 0)
                self.sums[3 + 2 * j : 5 + 2 * j] += torch.tensor([stats[key] * weight, weight], dtype=torch.float64)

    def reduce(self, all_reduce=None, prefix: str = "val") -> dict[str, float]:
        """The means over every sample seen (``all_reduce``: sums a tensor over ranks, e.g.
        ``lit_gspo.runtime.collectives.all_reduce_sum``), keyed ``<prefix>/reward``, ``<prefix>/response_length``, ``<prefix>/<key>``."""
        sums = all_reduce(self.sums.clone()) if all_reduce is not None else self.sums
        samples = sums[1].clamp(min=1)
        out = {f"{prefix}/reward": float(sums[0] / samples), f"{prefix}/response_length": float(sums[2] / samples)}
        for j, key in enumerate(self.keys):
            if sums[4 + 2 * j] > 0:
                out[f"{prefix}/{key}"] = float(sums[3 + 2 * j] / sums[4 + 2 * j])
        return out


def summed_over(per_rank: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``all_reduce`` for :meth:`RewardTally.reduce` and :meth:`PassAtK.reduce` whose ranks are the tallies
    ``per_rank`` of one process: their sums added in rank order, as a collective over those ranks adds them."""
    return lambda _: functools.reduce(torch.add, [tally.sums for tally in per_rank])


class PassAtK:
    """pass@k of n sampled completions per prompt, summed over prompts (and over ranks: :meth:`reduce`), so the result
    does not depend on how the prompts are split over processes or batches.

        c_i = #{samples of prompt i with R ≥ threshold, reward not failed}
        pass@k = Σ_i pass_at_k(n, c_i, k) / #prompts
    """

    def __init__(self, n: int, ks: list[int], threshold: float) -> None:
        if any(not 1 <= k <= n for k in ks):
            raise ValueError(f"every k of pass@k must be in [1, n={n}], got {ks}")
        self.n, self.ks, self.threshold = n, list(ks), threshold
        self.sums = torch.zeros(len(self.ks) + 1, dtype=torch.float64)  # Σ_i pass@k per k, then #prompts

    def add(self, batch) -> torch.Tensor:
        """Counts a batch of n samples per prompt (group-major rows, as ``Collector.sample`` gives them); returns which
        samples are solved, (prompts, n)."""
        flat = batch.rewards.float().cpu()
        solved = ((flat >= self.threshold) & ~failed_samples(batch)).view(-1, self.n)
        for c in solved.sum(1).tolist():
            self.sums[:-1] += torch.tensor([pass_at_k(self.n, c, k) for k in self.ks], dtype=torch.float64)
        self.sums[-1] += solved.shape[0]
        return solved

    def reduce(self, all_reduce=None, prefix: str = "val") -> dict[str, float]:
        """``<prefix>/pass@<k>`` for each k (``pass@<k>`` without a prefix; ``all_reduce``: sums a tensor over ranks;
        None: this process's prompts)."""
        sums = all_reduce(self.sums.clone()) if all_reduce is not None else self.sums
        prompts, start = sums[-1].clamp(min=1), f"{prefix}/" if prefix else ""
        return {f"{start}pass@{k}": float(sums[j] / prompts) for j, k in enumerate(self.ks)}


@torch.no_grad()
def evaluate(
    policy: nn.Module,
    collector: Collector,
    rows: list[dict],
    *,
    greedy: bool = True,
    samples: int = 0,
    ks: list[int] | None = None,
    temperature: float | None = None,
    threshold: float = 1.0,
    greedy_batch_size: int = 64,
    sample_batch_size: int = 8,
    seed: int | Sequence[int] | None = 0,
    world_size: int = 1,
) -> dict:
    """Greedy and sampled metrics of ``policy`` on ``rows`` with ``collector``'s environment, engine and rewards.

    Args:
        greedy: score one greedy completion per prompt (``collector.generation.val_max_new_tokens`` or
            ``max_new_tokens`` new tokens, as validation).
        samples: n completions per prompt for mean@n and pass@k (0: none), at ``temperature`` (None: the
            collector's), within ``val_max_new_tokens`` (or ``max_new_tokens``), as a sampled validation, with the
            collector's ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``.
        ks: the k of pass@k (each ≤ n; None: 1, 2, 4, ..., n).
        threshold: a sample is solved when its reward is ≥ this.
        greedy_batch_size, sample_batch_size: prompts per ``Collector.sample`` call.
        seed: ``torch.manual_seed`` right before sampling (None: the RNG as it is); with ``world_size`` > 1, one
            seed per process: process r's shares are drawn from a stream seeded ``seed[r]``.
        world_size: sample each batch as this many processes validate it: process r takes prompts r, r + W, ...
            (:func:`shares`), and the tallies are summed over processes, as a run on W processes logs them.

    Returns a JSON-ready dict: ``prompts``, ``threshold``, ``greedy`` (``reward``, ``accuracy``,
    ``response_length``, ``reward_failed``, ``rewards/<function>/mean``, and a multi-turn environment's ``turns``,
    ``success``, ...), ``sampled`` (``samples``,
    ``temperature``, ``mean@<n>``, ``pass@<k>``..., ``solved_share`` = pass@n), and ``per_prompt``: for each row
    its prompt, answer, greedy completion and reward, and the rewards of its samples.
    """
    if not rows:
        raise ValueError("no rows to evaluate")
    if samples < 0 or greedy_batch_size < 1 or sample_batch_size < 1:
        raise ValueError(
            f"samples must be >= 0 and batch sizes >= 1, got {samples}, {greedy_batch_size}, {sample_batch_size}"
        )
    seeds = list(seed) if isinstance(seed, Sequence) else [seed] * (world_size == 1)
    if world_size < 1 or (samples and len(seeds) != world_size):
        raise ValueError(
            f"world_size must be >= 1 and seed one int, or one per process (each draws from its own stream), got "
            f"world_size={world_size}, seed={seed!r}"
        )
    ks = default_ks(samples) if ks is None else sorted(set(ks))
    if samples and any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"every k of pass@k must be in [1, samples={samples}], got {ks}")
    per_prompt = [{"prompt": r.get("prompt"), "answer": r.get("answer")} for r in rows]
    result: dict = {"prompts": len(rows), "threshold": threshold}
    was_training = policy.training
    policy.eval()
    try:
        if greedy:
            result["greedy"] = _greedy(policy, collector, rows, per_prompt, threshold, greedy_batch_size, world_size)
        if samples:
            result["sampled"] = _sampled(
                policy, collector, rows, per_prompt, samples, ks, temperature, threshold, sample_batch_size, seeds
            )
    finally:
        policy.train(was_training)
    result["per_prompt"] = per_prompt
    return result


def _greedy(policy, collector, rows, per_prompt, threshold, batch_size, world_size) -> dict:
    tallies, solved, stats = [RewardTally() for _ in range(world_size)], torch.zeros(len(rows), dtype=torch.bool), []
    for rank, indices in shares(len(rows), batch_size, world_size):
        batch, replies, batch_stats = collector.sample(policy, [rows[i] for i in indices], greedy=True)
        tallies[rank].add(batch, batch_stats)
        r = batch.rewards.float().cpu()  # (B,)
        ok = (r >= threshold) & ~failed_samples(batch)
        for i, reply, reward, good in zip(indices, replies, r.tolist(), ok.tolist()):
            per_prompt[i].update(greedy_completion=reply, greedy_reward=reward, greedy_solved=bool(good))
        solved[indices] = ok
        stats.append(batch_stats)
    g = collector.generation
    means = tallies[0].reduce(summed_over(tallies), prefix="greedy")
    return {
        "reward": means["greedy/reward"],
        "accuracy": float(solved.float().mean()),
        "response_length": means["greedy/response_length"],
        "max_new_tokens": g.validation_budget,
        **_aggregate_stats(stats),
    }


@contextmanager
def sampling(collector: Collector, n: int, temperature: float | None = None, max_new_tokens: int | None = None):
    """``collector.sample`` draws n completions per prompt at ``temperature`` (None: the collector's), at most
    ``max_new_tokens`` new tokens each (None: the collector's), while in this context; its other settings (top-p,
    top-k, min-p, repetition penalty, stop strings) are the collector's."""
    original = collector.generation
    collector.generation = dataclasses.replace(
        original,
        num_generations=n,
        temperature=original.temperature if temperature is None else temperature,
        max_new_tokens=original.max_new_tokens if max_new_tokens is None else max_new_tokens,
    )
    try:
        yield collector.generation
    finally:
        collector.generation = original


def _sampled(policy, collector, rows, per_prompt, n, ks, temperature, threshold, batch_size, seeds) -> dict:
    """mean@n, pass@k and the mean length of n samples per prompt, within the validation's budget
    (``val_max_new_tokens``), tallied as a sampled validation on ``len(seeds)`` processes tallies ``val/reward`` and
    ``val/pass@k``: each process's shares drawn in order from its own stream (``seeds``; None: the RNG as it is)."""
    passes = [PassAtK(n, ks, threshold) for _ in seeds]
    tallies = [RewardTally() for _ in seeds]
    with sampling(collector, n, temperature, collector.generation.validation_budget) as g:
        stats, seeded = [], None
        for rank, indices in shares(len(rows), batch_size, len(seeds)):
            if rank != seeded and seeds[rank] is not None:
                torch.manual_seed(seeds[rank])  # the process's stream, as its validation seeds it
            seeded = rank
            batch, _, batch_stats = collector.sample(policy, [rows[i] for i in indices])
            r = batch.rewards.float().cpu().view(len(indices), n)  # group-major: n samples per prompt
            solved = passes[rank].add(batch)
            tallies[rank].add(batch, batch_stats)
            for j, i in enumerate(indices):
                per_prompt[i].update(sample_rewards=r[j].tolist(), samples_solved=int(solved[j].sum()))
            stats.append(batch_stats)
    means = tallies[0].reduce(summed_over(tallies), prefix="sampled")
    out = {
        "samples": n,
        "temperature": g.temperature,
        "max_new_tokens": g.max_new_tokens,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "min_p": g.min_p,
        "repetition_penalty": g.repetition_penalty,
        f"mean@{n}": means["sampled/reward"],
    }
    out.update(passes[0].reduce(summed_over(passes), prefix=""))
    out["response_length"] = means["sampled/response_length"]
    out.update(_aggregate_stats(stats))
    return out


def format_table(result: dict) -> str:
    """The metrics as a small text table (one line per metric)."""
    lines = [f"{result['prompts']} prompts, solved = reward >= {result['threshold']:g}"]
    rows = []
    if "greedy" in result:
        g = result["greedy"]
        rows += [
            ("greedy", "reward (mean)", g["reward"]),
            ("greedy", "accuracy", g["accuracy"]),
            ("greedy", "response length", g["response_length"]),
        ]
        rows += [("greedy", key, g[key]) for key in EPISODE_KEYS if key in g]
        if g["reward_failed"]:
            rows.append(("greedy", "reward failed (samples)", g["reward_failed"]))
    if "sampled" in result:
        s = result["sampled"]
        where = f"n={s['samples']}, T={s['temperature']:g}"
        rows += [(where, key, value) for key, value in s.items() if key.startswith(("mean@", "pass@"))]
        rows.append((where, "response length", s["response_length"]))
        rows += [(where, key, s[key]) for key in EPISODE_KEYS if key in s]
        if s["reward_failed"]:
            rows.append((where, "reward failed (samples)", s["reward_failed"]))
    width = max(len(r[0]) for r in rows) if rows else 0
    name_width = max(len(r[1]) for r in rows) if rows else 0
    lines += [f"  {a:<{width}}  {b:<{name_width}}  {c:8.4f}" for a, b, c in rows]
    return "\n".join(lines)
