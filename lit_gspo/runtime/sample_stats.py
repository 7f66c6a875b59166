"""The logged stats of several sets of samples merged into the stats of their union: a step's sampling rounds (dynamic
sampling's refills), then its ranks.

A stat ``k`` that is a mean over samples comes with ``WEIGHT + k``, how many samples it is a mean over; merged, it is
the mean weighted by them, and its weight their sum (so that merging again, rounds then ranks, stays exact). A ``…/std``
beside a weighted ``…/mean`` (Bessel-corrected) is pooled:

    N = Σ n_i,   m = Σ n_i m_i / N,   s² = (Σ (n_i − 1) s_i² + Σ n_i (m_i − m)²) / (N − 1)

the std of the union's values. Counts (:data:`COUNTS`: failed rewards, dropped samples) are summed, ``time/*`` and
``sampling_rounds`` take the max, any other key the mean of the finite values reported.
"""

from __future__ import annotations

import math

#: stats that count samples: the union's is their sum
COUNTS = ("reward_failed", "async/dropped", "async/dropped_total")
#: the prefix of a stat's weight key: ``WEIGHT + k`` holds how many samples the stat ``k`` is a mean over (not logged)
WEIGHT = "weight/"


def weighted(stats: dict[str, float], weight: float, keys=None) -> dict[str, float]:
    """``stats`` with ``weight`` as the weight of each of ``keys`` (None: all) that has none yet and is a mean (no
    count, no pooled std), in place."""
    for key in list(stats) if keys is None else keys:
        pooled = key.endswith("/std") and WEIGHT + key[: -len("std")] + "mean" in stats
        if not key.startswith(WEIGHT) and WEIGHT + key not in stats and not pooled and key not in COUNTS:
            stats[WEIGHT + key] = float(weight)
    return stats


def without_weights(stats: dict[str, float]) -> dict[str, float]:
    """What is logged: ``stats`` without their weights."""
    return {k: v for k, v in stats.items() if not k.startswith(WEIGHT)}


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The stats of the union of the sample sets whose stats are ``parts`` (weights kept, summed)."""
    keys = dict.fromkeys(k for part in parts for k in part if not k.startswith(WEIGHT))  # in first-seen order
    out: dict[str, float] = {}
    for key in keys:
        reported = [part for part in parts if key in part]
        values = [float(part[key]) for part in reported]
        finite = [v for v in values if math.isfinite(v)]
        if all(WEIGHT + key in part for part in reported):
            out[key], out[WEIGHT + key] = weighted_mean(key, reported)
        elif key.endswith("/std") and all(WEIGHT + key[: -len("std")] + "mean" in part for part in reported):
            out[key] = pooled_std(key, reported)
        elif key in COUNTS:
            out[key] = sum(values)
        elif key.startswith("time/") or key == "sampling_rounds":
            out[key] = max(finite) if finite else math.nan
        else:
            out[key] = sum(finite) / len(finite) if finite else math.nan
    return out


def weighted_mean(key: str, parts: list[dict[str, float]]) -> tuple[float, float]:
    """(the mean of ``key`` over the parts' samples, how many there are); NaN where none: a part of weight 0 counts
    nothing, whatever its value (a mean over no sample is NaN)."""
    pairs = [(float(part[key]), float(part[WEIGHT + key])) for part in parts if part[WEIGHT + key] > 0]
    total = sum(w for _, w in pairs)
    return (sum(v * w for v, w in pairs) / total if total else math.nan), total


def pooled_std(key: str, parts: list[dict[str, float]]) -> float:
    """The Bessel-corrected std over the parts' samples of the ``…/std`` ``key``, from each part's n, mean and std."""
    mean_key = key[: -len("std")] + "mean"
    sets = [(float(p[WEIGHT + mean_key]), float(p[mean_key]), float(p[key])) for p in parts if p[WEIGHT + mean_key] > 0]
    n = sum(count for count, _, _ in sets)
    if n < 2:
        return math.nan
    mean = sum(count * m for count, m, _ in sets) / n
    within = sum((count - 1) * s * s for count, _, s in sets if count > 1)
    between = sum(count * (m - mean) ** 2 for count, m, _ in sets)
    return math.sqrt((within + between) / (n - 1))
