"""Off-policy ratio diagnostics: how far the product of token ratios drifts, and how that grows with length.

Token-level objectives (PPO, GRPO, DAPO) clip each r_t = π_θ(y_t)/π_old(y_t) separately, so the
sequence likelihood ratio

    ∏_t r_t = exp( Σ_t m_t log r_t )

is never bounded: small per-token drifts add up over the sequence. GSPO clips the length-normalised
s_i = exp( Σ_t m_t log r_t / |y_i| ) instead. These diagnostics show the effect on a real update:

* ``seq_logratio_std`` / ``seq_logratio_absmax``: std and max |.| of Σ_t log r_t over sequences,
  overall and per length bucket (``..._len{lo}-{hi}``, lengths lo..hi inclusive);
* ``seq_logratio_len_corr``: Pearson correlation of |Σ_t log r_t| with the length |y_i|;
* ``seq_geo_logratio_std``: std of log s_i = Σ_t log r_t / |y_i| (what GSPO clips);
* ``token_ratio_var_pos{lo}-{hi}``: the variance of r_t over the tokens at positions lo..hi (0-based).

Over every rank's sequences and tokens (gathered), as one process would compute them. Buckets split 1..``max_len``
(lengths) and 0..``max_len``−1 (positions) into ``num_buckets`` contiguous ranges of near-equal width, so the keys
are the same at every step of a run (loggers that keep a key's last value would otherwise repeat stale numbers).
Undefined statistics (an empty bucket, fewer than two values, a constant length) are NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lit_gspo.runtime.collectives import gather_cat


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ_t m_t (logp_t − old_logp_t), |y_i|) per sequence, both (B,) float64; padding never leaks in."""
    mask = mask.bool()
    diff = torch.where(mask, logprobs.double() - old_logprobs.double(), torch.zeros((), dtype=torch.float64))
    return diff.sum(1), mask.sum(1).double()


def buckets(max_len: int, num_buckets: int, start: int = 1) -> list[tuple[int, int]]:
    """``num_buckets`` contiguous inclusive ranges covering start..start+max_len−1 (fewer if max_len is small)."""
    n = max(1, min(num_buckets, max_len))
    edges = [start + round(i * max_len / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(n) if edges[i + 1] > edges[i]]


NAN = float("nan")


def _std(x: Tensor) -> float:
    return float(x.std(unbiased=False)) if x.numel() >= 2 else NAN


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation; NaN when fewer than two points or either side is constant."""
    if x.numel() < 2:
        return NAN
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denom if denom > 0 else NAN


class RatioStats:
    """Accumulates the log-ratios of the micro-batches of one RL step; :meth:`compute` returns the metrics."""

    def __init__(self) -> None:
        self.added: list[tuple[Tensor, Tensor, Tensor]] = []  # detached, where they were made: read at compute()
        self.seq_sums: list[Tensor] = []
        self.lengths: list[Tensor] = []
        self.token_log_ratios: list[Tensor] = []
        self.positions: list[Tensor] = []

    def add(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> None:
        """Record one micro-batch ((B, T) tensors; detached, left on their device until :meth:`compute`: a copy to
        the host here would wait for the forward between it and its backward)."""
        self.added.append((logprobs.detach(), old_logprobs.detach(), mask.detach()))

    def _on_host(self) -> None:
        for logprobs, old_logprobs, mask in self.added:
            logprobs, old_logprobs, mask = logprobs.cpu(), old_logprobs.cpu(), mask.cpu().bool()
            sums, lengths = sequence_log_ratio(logprobs, old_logprobs, mask)
            keep = lengths > 0
            self.seq_sums.append(sums[keep])
            self.lengths.append(lengths[keep])
            pos = torch.arange(mask.shape[1]).expand_as(mask)
            self.token_log_ratios.append((logprobs.double() - old_logprobs.double())[mask])
            self.positions.append(pos[mask])
        self.added = []

    def __len__(self) -> int:
        self._on_host()
        return sum(len(s) for s in self.seq_sums)

    def compute(self, max_len: int, num_buckets: int = 3) -> dict[str, float]:
        """The metrics over everything added on every rank (all NaN when nothing was; collective: every rank must
        call it), so that a run on several ranks logs what one process logs."""
        self._on_host()
        joined = (
            torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
            for parts, dtype in (
                (self.seq_sums, torch.float64),
                (self.lengths, torch.float64),
                (self.token_log_ratios, torch.float64),
                (self.positions, torch.int64),
            )
        )
        return ratio_diagnostics(*(gather_cat(part) for part in joined), max_len=max_len, num_buckets=num_buckets)


def ratio_diagnostics(
    seq_log_ratios: Tensor,
    lengths: Tensor,
    token_log_ratios: Tensor,
    positions: Tensor,
    *,
    max_len: int,
    num_buckets: int = 3,
) -> dict[str, float]:
    """The metrics of the module docstring from per-sequence (Σ log r, |y|) and per-token (log r, position)."""
    s, L = seq_log_ratios.double(), lengths.double()
    absmax = lambda x: float(x.abs().max()) if x.numel() else NAN
    out = {
        "seq_logratio_std": _std(s),
        "seq_logratio_absmax": absmax(s),
        "seq_geo_logratio_std": _std(s / L.clamp(min=1)),
        "seq_logratio_len_corr": pearson(s.abs(), L),
    }
    for lo, hi in buckets(max_len, num_buckets, start=1):
        sel = s[(L >= lo) & (L <= hi)]
        out[f"seq_logratio_std_len{lo}-{hi}"] = _std(sel)
        out[f"seq_logratio_absmax_len{lo}-{hi}"] = absmax(sel)
    ratios = token_log_ratios.double().exp()
    for lo, hi in buckets(max_len, num_buckets, start=0):
        sel = ratios[(positions >= lo) & (positions <= hi)]
        out[f"token_ratio_var_pos{lo}-{hi}"] = float(sel.var(unbiased=False)) if sel.numel() >= 2 else NAN
    return out
