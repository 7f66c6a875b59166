"""Properties every registered objective must have: split invariance, padding invariance,
robustness to empty rows and to extreme (±20) log-ratios."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_gspo.rl.objectives import AGGREGATIONS, KL_ESTIMATORS, OBJECTIVES, Counts, get_objective

NAMES = [
    "ppo",
    "grpo",
    "dapo",
    "gspo",
    "gspo_token",
    "dr_grpo",
    "cispo",
    "gmpo",
    "sapo",
    "dppo",
    "clip_cov",
    "kl_cov",
    "vespo",
    "luspo",
]
# Clip-Cov and KL-Cov pick tokens by the covariance of the batch given to the loss (its means and its N, as verl
# does per micro-batch), so their gradient depends on the split; the split test switches the selection off for them
# and checks everything else (the surrogate, the Counts normalisers).
NO_COV_SELECTION = {"clip_cov": {"clip_cov_lb": 1e6, "clip_cov_ub": 2e6}, "kl_cov": {"kl_cov_coef": 0.0}}


def batch(seed=0, B=6, T=7, spread=0.3):
    """Right-padded batch with varied lengths (one row empty) and log-ratios that clip some tokens."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    lp = old + spread * torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    return lp, old, adv, mask, ref


def hparams(name, aggregation=None, beta=0.0):
    kw = {"beta": beta}
    if aggregation:
        kw["aggregation"] = aggregation
    if name in ("gspo", "gspo_token", "luspo"):  # widen GSPO's band so this batch has clipped and unclipped rows
        kw.update(clip_low=0.05, clip_high=0.05)
    return kw


def loss_and_grad(obj, lp, *args, **kw):
    torch.manual_seed(0)  # Clip-Cov draws its tokens with torch's RNG: the same draw in every compared call
    leaf = lp.clone().requires_grad_(True)
    out = obj(leaf, *args, **kw)
    out.loss.backward()
    return out, leaf.grad


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_split_invariance(name, aggregation):
    """The gradient of a batch equals the sum of its micro-batches' gradients with the step's Counts,
    even when each micro-batch is trimmed to its own padded width."""
    lp, old, adv, mask, ref = batch()
    obj = get_objective(name, **hparams(name, aggregation, beta=0.1), **NO_COV_SELECTION.get(name, {}))
    counts = Counts.of(mask)
    full, full_grad = loss_and_grad(obj, lp, old, adv, mask, counts=counts, ref_logprobs=ref)
    leaf = lp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        width = max(int(mask[rows].sum(1).max()), 1)
        part = obj(
            leaf[rows, :width],
            old[rows, :width],
            adv[rows],
            mask[rows, :width],
            counts=counts,
            ref_logprobs=ref[rows, :width],
        )
        part.loss.backward()
        total = total + part.loss.detach()
    torch.testing.assert_close(total, full.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad, full_grad, rtol=1e-5, atol=1e-7)
    assert full_grad.abs().sum() > 0


def test_split_invariance_with_value_loss():
    lp, old, adv, mask, _ = batch()
    values, old_values, returns = (torch.randn(6, 7, generator=torch.Generator().manual_seed(i)) for i in range(3))
    counts = Counts.of(mask)
    v_full = values.clone().requires_grad_(True)
    full, g_full = loss_and_grad(
        get_objective("ppo"),
        lp,
        old,
        adv[:, None] * mask,
        mask,
        counts=counts,
        values=v_full,
        old_values=old_values,
        returns=returns,
    )
    v_parts = values.clone().requires_grad_(True)
    for rows in (slice(0, 3), slice(3, 6)):
        get_objective("ppo")(
            lp[rows],
            old[rows],
            (adv[:, None] * mask)[rows],
            mask[rows],
            counts=counts,
            values=v_parts[rows],
            old_values=old_values[rows],
            returns=returns[rows],
        ).loss.backward()
    torch.testing.assert_close(v_parts.grad, v_full.grad)


@pytest.mark.parametrize("name", NAMES)
def test_padding_invariance(name):
    """Extra padded positions holding inf/NaN change neither loss, gradients nor metrics.
    (Dr. GRPO's L is the generation budget, so the Counts carry it instead of the padded width.)"""
    lp, old, adv, mask, ref = batch()
    B, T, extra = *lp.shape, 4
    pad = lambda x, v: torch.cat([x, torch.full((B, extra), v)], 1)  # noqa: E731
    adv_tok = adv[:, None].expand(B, T).clone()
    obj = get_objective(name, **hparams(name, beta=0.1))
    counts = Counts.of(mask, max_len=16)
    a, ga = loss_and_grad(obj, lp, old, adv_tok, mask, counts=counts, ref_logprobs=ref)
    b, gb = loss_and_grad(
        obj,
        pad(lp, float("nan")),
        pad(old, float("inf")),
        pad(adv_tok, float("nan")),
        pad(mask, 0.0),
        counts=counts,
        ref_logprobs=pad(ref, float("-inf")),
    )
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(gb[:, :T], ga)
    assert (gb[:, T:] == 0).all()
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], msg=key)
    # invalid (masked) positions of the original batch may hold garbage too
    lp2, old2 = lp.clone(), old.clone()
    lp2[mask == 0], old2[mask == 0] = float("nan"), float("-inf")
    c, gc = loss_and_grad(obj, lp2, old2, adv_tok, mask, counts=counts, ref_logprobs=ref)
    torch.testing.assert_close(c.loss, a.loss)
    torch.testing.assert_close(gc, ga)


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_rows_and_batches_are_finite(name):
    lp, old, adv, mask, ref = batch()  # row 2 is empty
    lp[2] = float("nan")
    obj = get_objective(name, beta=0.1)
    out, grad = loss_and_grad(obj, lp, old, adv, mask, ref_logprobs=ref)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and (grad[2] == 0).all()
    empty = torch.zeros_like(mask)
    out, grad = loss_and_grad(obj, lp, old, adv, empty, ref_logprobs=ref)
    assert out.loss.item() == 0.0 and (grad == 0).all()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    log_ratio_scale=st.sampled_from([0.0, 1e-3, 1.0, 20.0]),
    token_adv=st.booleans(),
    beta=st.sampled_from([0.0, 0.5]),
    kl_estimator=st.sampled_from(KL_ESTIMATORS),
)
def test_finite_loss_and_gradients(B, T, seed, log_ratio_scale, token_adv, beta, kl_estimator):
    """Random shapes, masks, lengths and log-ratios up to ±20: every objective stays finite."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 30
    log_ratio = (torch.rand(B, T, generator=g) * 2 - 1) * log_ratio_scale
    lp = old + log_ratio
    mask = torch.rand(B, T, generator=g) < 0.7
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask &= torch.arange(T)[None] < lengths[:, None]
    adv = torch.randn((B, T) if token_adv else (B,), generator=g) * 5
    ref = lp + (torch.rand(B, T, generator=g) * 2 - 1) * log_ratio_scale
    for name in sorted(OBJECTIVES):
        obj = get_objective(name, beta=beta, kl_estimator=kl_estimator)
        extra = {}
        if obj.needs_critic:
            extra = {k: torch.randn(B, T, generator=g) for k in ("values", "old_values", "returns")}
        out, grad = loss_and_grad(obj, lp, old, adv, mask, ref_logprobs=ref, **extra)
        assert torch.isfinite(out.loss), name
        assert torch.isfinite(grad).all(), name
        assert all(torch.isfinite(v).all() for v in out.metrics.values()), name
        assert 0.0 <= out.metrics["clip_frac"].item() <= 1.0
