"""Objectives: hand-computed values, GSPO identities, on-policy behaviour, KL, registry and bad input."""

import inspect
import math

import pytest
import torch

from lit_gspo.rl.objectives import (
    CISPO,
    DAPO,
    DPPO,
    GMPO,
    GRPO,
    GSPO,
    LUSPO,
    OBJECTIVES,
    PPO,
    SAPO,
    VESPO,
    Aggregation,
    ClipCov,
    DrGRPO,
    GSPOToken,
    KLCov,
    Objective,
    get_objective,
    kl_penalty,
)

ALL = [
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


def grad_of(objective, logprobs, *args, **kw):
    lp = logprobs.clone().requires_grad_(True)
    out = objective(lp, *args, **kw)
    out.loss.backward()
    return out, lp.grad


def ratio_batch(ratios, mask=None):
    """old_logprobs = 0, logprobs = log(ratio): the ratios of the example are readable as numbers."""
    ratios = torch.tensor(ratios, dtype=torch.float32)
    mask = torch.ones_like(ratios) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return ratios.log(), torch.zeros_like(ratios), mask


# ---- hand-computed values ------------------------------------------------------------------------
# Shared token-level example: ratios [[1.5, 0.9], [0.5, pad]], Â = [+1, −1], 3 valid tokens.
#   row 0 (Â=+1): t0 min(1.5, clip 1.2) = 1.2 → ℓ = −1.2 (clipped high); t1 min(0.9, 0.9) → ℓ = −0.9
#   row 1 (Â=−1): t0 min(−0.5, −clip 0.8) = −0.8 → ℓ = +0.8 (clipped low)
TOKEN_EXAMPLE = ([[1.5, 0.9], [0.5, 1.0]], [[1, 1], [1, 0]])
ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("ppo", (-1.2 - 0.9 + 0.8) / 3),  # token-mean: sum over 3 valid tokens / 3
        ("grpo", ((-1.2 - 0.9) / 2 + 0.8) / 2),  # seq-mean-token-mean: row means −1.05 and 0.8, averaged
        ("dr_grpo", (-1.2 - 0.9 + 0.8) / (2 * 2)),  # seq-mean-token-sum-norm: token sums / (N_seqs · L=2)
        ("dapo", (-1.28 - 0.9 + 0.8) / 3),  # clip-higher: row 0 t0 is clipped at 1.28 instead of 1.2
    ],
)
def test_ppo_family_hand_values(name, expected):
    lp, old, mask = ratio_batch(*TOKEN_EXAMPLE)
    out = get_objective(name)(lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    # 2 of 3 valid tokens have a zeroed gradient: one above the band (Â>0), one below it (Â<0)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)
    assert out.metrics["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.9 + 0.5) / 3)
    assert out.metrics["ratio_min"].item() == pytest.approx(0.5)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)


def test_ppo_gradient_hand_values():
    # token-mean over 3 tokens; ℓ = −r Â where unclipped, so dℓ/dlogp = −r Â / 3 there, 0 where clipped
    lp, old, mask = ratio_batch(*TOKEN_EXAMPLE)
    _, grad = grad_of(PPO(), lp, old, ADV, mask)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.9 / 3], [0.0, 0.0]]))


def test_ppo_dual_clip():
    # Â = −1, r = 4: plain PPO loss −min(−4, −1.2) = 4 (unbounded in r); dual clip c = 3 caps it at −cÂ = 3
    lp, old, mask = ratio_batch([[4.0, 1.0]])
    adv = torch.tensor([-1.0])
    plain, g_plain = grad_of(PPO(), lp, old, adv, mask)
    dual, g_dual = grad_of(PPO(dual_clip=3.0), lp, old, adv, mask)
    assert plain.loss.item() == pytest.approx((4.0 + 1.0) / 2)
    assert dual.loss.item() == pytest.approx((3.0 + 1.0) / 2)
    assert g_plain[0, 0].item() == pytest.approx(4.0 / 2)  # d(−rÂ)/dlogp = −rÂ = 4, / 2 tokens
    assert g_dual[0, 0].item() == 0.0
    assert dual.metrics["dual_clip_frac"].item() == pytest.approx(0.5)
    assert dual.metrics["clip_frac"].item() == pytest.approx(0.5)
    assert plain.metrics["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        PPO(dual_clip=1.0)


def test_ppo_value_clip_counts_no_in_band_token_as_clipped():
    """V − V_old = 0.166 is inside δ = 0.2: V_old + clamp(V − V_old, ±δ) is not bit-equal to V in fp32 here
    (the old formula counted this token as clipped); the clipped value must be V itself."""
    t = lambda x: torch.tensor([[x]])  # noqa: E731
    out = PPO()(
        t(-1.0),
        t(-1.0),
        torch.zeros(1),
        torch.ones(1, 1, dtype=torch.bool),
        values=t(0.07671012729406357),
        old_values=t(-0.08940243721008301),
        returns=t(-0.6209129691123962),
    )
    assert out.metrics["value_clip_frac"].item() == 0.0
    g = torch.Generator().manual_seed(0)
    old_v, values = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g) * 0.3
    values = old_v + values  # about a third of the tokens outside the ±0.2 band
    returns = torch.randn(64, 32, generator=g)
    out = PPO()(
        torch.zeros(64, 32),
        torch.zeros(64, 32),
        torch.zeros(64),
        torch.ones(64, 32, dtype=torch.bool),
        values=values,
        old_values=old_v,
        returns=returns,
    )
    outside = (values - old_v).abs() > 0.2
    clipped_wins = (old_v + (values - old_v).clamp(-0.2, 0.2) - returns).square() > (values - returns).square()
    assert out.metrics["value_clip_frac"].item() == pytest.approx(float((outside & clipped_wins).float().mean()))


def test_ppo_value_loss_hand_values():
    # Â = 0: only the value loss remains. token 0: V=1, V_old=0.5, R=2 → clipped V = 0.7;
    #   max((1−2)², (0.7−2)²) = 1.69 → ½·1.69 = 0.845 (clipped term wins, zero grad to V)
    # token 1: V=1.9, V_old=1.8, R=2 → both 0.01 → 0.005. token-mean: 0.425; × vf_coef 0.5 = 0.2125
    lp, old, mask = ratio_batch([[1.0, 1.0]])
    values = torch.tensor([[1.0, 1.9]], requires_grad=True)
    out = PPO()(
        lp,
        old,
        torch.zeros(1),
        mask,
        values=values,
        old_values=torch.tensor([[0.5, 1.8]]),
        returns=torch.tensor([[2.0, 2.0]]),
    )
    assert out.loss.item() == pytest.approx(0.2125, abs=1e-6)
    assert out.metrics["value_loss"].item() == pytest.approx(0.425, abs=1e-6)
    assert out.metrics["value_clip_frac"].item() == pytest.approx(0.5)
    out.loss.backward()
    # token 1: d/dV ½(V−R)² = V−R = −0.1, / 2 tokens, × 0.5 = −0.025
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.025]]))
    with pytest.raises(ValueError, match="old_values, returns"):
        PPO()(lp, old, torch.zeros(1), mask, values=values)


def test_gspo_hand_values():
    # row 0: Δ = [ln 2, 0] → s = exp(ln2 / 2) = √2; Â = +1, band 0.2 → clipped at 1.2, ℓ = −1.2
    # row 1: Δ = [ln 0.9] (1 valid token) → s = 0.9; Â = −1 → ℓ = 0.9.   loss = (−1.2 + 0.9) / 2
    lp, old, mask = ratio_batch([[2.0, 1.0], [0.9, 1.0]], [[1, 1], [1, 0]])
    out, grad = grad_of(GSPO(clip_low=0.2, clip_high=0.2), lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx(-0.15, abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)  # both tokens of row 0
    assert out.metrics["clip_frac_high"].item() == pytest.approx(2 / 3)
    assert out.metrics["ratio_mean"].item() == pytest.approx((math.sqrt(2) + 0.9) / 2, rel=1e-6)
    assert out.metrics["ratio_max"].item() == pytest.approx(math.sqrt(2), rel=1e-6)
    # row 0 clipped → no gradient; row 1: d(−s Â)/dlogp = s/|y| = 0.9, / N_seqs = 2
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [0.45, 0.0]]))


def test_gmpo_hand_values():
    # ε = 0.4 in log space. row 0 (Â=+1): Δ = [0.6, 0] → min(Δ, 0.4) = [0.4, 0] → s = e^0.2, ℓ = −e^0.2
    # row 1 (Â=−1): Δ = [−0.5] → max(Δ, −0.4) = −0.4 → s = e^−0.4, ℓ = +e^−0.4.  loss = mean of the two
    lp = torch.tensor([[0.6, 0.0], [-0.5, 0.0]])
    old, mask = torch.zeros(2, 2), torch.tensor([[1, 1], [1, 0]])
    out, grad = grad_of(GMPO(), lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx((-math.exp(0.2) + math.exp(-0.4)) / 2, abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)
    assert out.metrics["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(0.3), rel=1e-6)  # unclipped geo-mean
    # only row 0 t1 is unclipped: d(−Â e^{mean Δ̃})/dΔ_1 = −e^0.2 / |y|=2, / N_seqs = 2
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.2) / 4], [0.0, 0.0]]))


def test_cispo_hand_values():
    # r = [5, 0.5], Â = 1, logp = [−1, −2]. Weights sg(clip(r, 0, 1 + 3)) = [4, 0.5] (first truncated).
    # ℓ = −w Â logp = [4, 1] → token-mean 2.5; gradient −w Â / 2 = [−2, −0.25]: no token loses its gradient
    lp = torch.tensor([[-1.0, -2.0]])
    old = lp - torch.tensor([[math.log(5.0), math.log(0.5)]])
    out, grad = grad_of(CISPO(), lp, old, torch.ones(1), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(2.5, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -0.25]]))
    assert out.metrics["clip_frac"].item() == 0.0
    assert out.metrics["is_clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["ratio_max"].item() == pytest.approx(5.0, rel=1e-5)


def test_defaults_and_class_attributes():
    table = {  # name: (ε_low, ε_high, aggregation, paper's advantage, needs_critic, paper's dynamic sampling)
        "ppo": (0.2, 0.2, "token-mean", "gae", True, False),
        "grpo": (0.2, 0.2, "seq-mean-token-mean", "group", False, False),
        "dapo": (0.2, 0.28, "token-mean", "group", False, True),
        "gspo": (3e-4, 4e-4, "seq-mean-token-mean", "group", False, False),
        "gspo_token": (3e-4, 4e-4, "seq-mean-token-mean", "group", False, False),
        "dr_grpo": (0.2, 0.2, "seq-mean-token-sum-norm", "group_mean", False, False),
        "cispo": (1.0, 3.0, "token-mean", "group", False, False),
        "gmpo": (0.4, 0.4, "seq-mean-token-mean", "group", False, False),
        "sapo": (0.0, 0.0, "seq-mean-token-mean", "group", False, False),  # no clip: τ_pos 1.0, τ_neg 1.05
        "dppo": (0.15, 0.15, "seq-mean-token-sum-norm", "group_mean", False, False),  # bounds on binary TV
        "clip_cov": (0.2, 0.2, "token-mean", "group", False, False),
        "kl_cov": (0.0, 0.0, "token-mean", "group", False, False),  # no clip: KL penalty on selected tokens
        "vespo": (0.0, 0.0, "token-mean", "group", False, False),  # no clip: Gamma kernel of the sequence weight
        "luspo": (2e-3, 2.5e-3, "seq-mean-token-sum", "group", False, False),
    }
    for name, (lo, hi, agg, est, critic, dyn) in table.items():
        obj = get_objective(name)
        assert (obj.clip_low, obj.clip_high, obj.aggregation) == (lo, hi, agg), name
        assert (obj.paper_advantage, obj.needs_critic, obj.paper_dynamic_sampling) == (est, critic, dyn), name
    classes = {
        "ppo": PPO,
        "grpo": GRPO,
        "dapo": DAPO,
        "gspo": GSPO,
        "gspo_token": GSPOToken,
        "dr_grpo": DrGRPO,
        "cispo": CISPO,
        "gmpo": GMPO,
        "sapo": SAPO,
        "dppo": DPPO,
        "clip_cov": ClipCov,
        "kl_cov": KLCov,
        "vespo": VESPO,
        "luspo": LUSPO,
    }
    for name, cls in classes.items():
        assert OBJECTIVES[name] is cls
        assert isinstance(get_objective(cls.__name__), cls)  # class names work too (LightningCLI style)
    # only PPO has a value loss: the token-clip objectives share its policy loss, not its critic
    assert [name for name, cls in classes.items() if hasattr(cls(), "vf_coef")] == ["ppo"]


@pytest.mark.parametrize("name", ALL)
def test_each_objectives_signature_holds_its_papers_defaults(name):
    """``--help`` shows the defaults of ``__init__``: they are the values an objective built without arguments uses (no
    None resolved later), and ``get_objective(name, **hparams)`` overrides them one by one."""
    cls = OBJECTIVES[name]
    params = inspect.signature(cls.__init__).parameters
    built = cls()
    for key in ("clip_low", "clip_high", "beta", "kl_estimator", "aggregation"):
        if key in params and not (cls is DPPO and key in ("clip_low", "clip_high")):  # DPPO's: its divergence's bound
            assert params[key].default is not None and params[key].default == getattr(built, key), key
    assert get_objective(name, beta=0.5).beta == 0.5


def test_gspo_defaults_are_the_papers_and_one_can_be_changed():
    assert (GSPO().clip_low, GSPO().clip_high, GSPO().aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert (DAPO().clip_low, DAPO().clip_high) == (0.2, 0.28)
    changed = get_objective("GSPO", clip_high=5e-4)
    assert (changed.clip_low, changed.clip_high) == (3e-4, 5e-4)
    assert (DPPO().clip_low, DPPO(divergence="binary_kl").clip_high) == (0.15, 0.05)


def test_ppo_signature_is_explicit_for_jsonargparse():
    params = inspect.signature(PPO.__init__).parameters
    for key in ("clip_low", "clip_high", "beta", "kl_estimator", "aggregation", "dual_clip", "value_clip", "vf_coef"):
        assert key in params
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    ppo = PPO(clip_high=0.3, dual_clip=3.0, vf_coef=1.0)
    assert (ppo.clip_high, ppo.dual_clip, ppo.vf_coef, ppo.value_clip) == (0.3, 3.0, 1.0, 0.2)


# ---- GSPO identities -----------------------------------------------------------------------------
def gspo_batch(seed=0, B=5, T=6, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + scale * torch.randn(B, T, generator=g)
    lengths = torch.tensor([6, 1, 4, 3, 5])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7])[:B]
    return lp, old, adv, mask


def test_gspo_ratio_is_geometric_mean_of_token_ratios():
    lp, old, _, mask = gspo_batch(scale=0.3)
    s = GSPO().sequence_ratio(lp, old, mask.bool())
    for i in range(lp.shape[0]):
        n = int(mask[i].sum())
        token_ratios = torch.exp(lp[i, :n] - old[i, :n]).double()
        assert s[i].item() == pytest.approx(token_ratios.prod().item() ** (1 / n), rel=1e-5)


def test_gspo_gradient_matches_formula():
    # ∇loss = −s_i Â_i (1/|y_i|) Σ_t ∇logp_t / N_seqs for unclipped sequences, 0 for clipped ones
    lp, old, adv, mask = gspo_batch()
    obj = GSPO()
    out, grad = grad_of(obj, lp, old, adv, mask)
    s = obj.sequence_ratio(lp, old, mask.bool())
    lengths = mask.sum(1)
    clipped = ((adv > 0) & (s > 1 + obj.clip_high)) | ((adv < 0) & (s < 1 - obj.clip_low))
    assert clipped.any() and (~clipped).any(), "the example must have both kinds of sequence"
    expected = torch.where(clipped, 0.0, -s * adv / lengths / lp.shape[0])[:, None] * mask
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    # clip_frac counts every token of a clipped sequence
    assert out.metrics["clip_frac"].item() == pytest.approx(
        (clipped.float() * lengths).sum().item() / lengths.sum().item()
    )


def test_gspo_token_equals_gspo_with_sequence_advantages():
    lp, old, adv, mask = gspo_batch(seed=2)
    a, ga = grad_of(GSPO(), lp, old, adv, mask)
    b, gb = grad_of(GSPOToken(), lp, old, adv[:, None].expand(-1, lp.shape[1]).clone(), mask)
    assert a.metrics["clip_frac"].item() > 0  # the example exercises clipping
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-6)
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], rtol=0, atol=1e-6)


def test_gspo_token_with_token_advantages_follows_its_formula():
    # ℓ_i = (1/|y_i|) Σ_t −min(s_{i,t} Â_{i,t}, clip(s_{i,t}) Â_{i,t}); ∂/∂logp_t = −s_i Â_{i,t} / |y_i| / N
    # unless that token is clipped (Â_{i,t} > 0 and s_i > 1 + ε_high, or Â_{i,t} < 0 and s_i < 1 − ε_low)
    lp, old, _, mask = gspo_batch(seed=4)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    obj = GSPOToken()
    out, grad = grad_of(obj, lp, old, adv, mask)
    s = obj.sequence_ratio(lp, old, mask.bool())[:, None].expand_as(lp)
    clipped = ((adv > 0) & (s > 1 + obj.clip_high)) | ((adv < 0) & (s < 1 - obj.clip_low))
    assert (clipped & mask.bool()).any() and (~clipped & mask.bool()).any()
    lengths = mask.sum(1, keepdim=True)
    expected = torch.where(clipped, 0.0, -s * adv / lengths / lp.shape[0]) * mask
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    loss = (-torch.minimum(s * adv, s.clamp(1 - obj.clip_low, 1 + obj.clip_high) * adv) * mask).sum(1) / lengths[:, 0]
    assert out.loss.item() == pytest.approx(loss.mean().item(), abs=1e-6)


# ---- on-policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_on_policy_ratio_is_one_and_nothing_clipped(name):
    lp, _, adv, mask = gspo_batch(seed=5)
    out = get_objective(name)(lp, lp.detach(), adv * 3, mask)
    # Clip-Cov detaches its covariance-selected tokens from the first update on: those alone are "clipped"
    expected = out.metrics["cov_clip_frac"].item() if name == "clip_cov" else 0.0
    assert out.metrics["clip_frac"].item() == expected
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        assert out.metrics[key].item() == 1.0


@pytest.mark.parametrize("name", ["ppo", "grpo", "dapo", "dr_grpo", "cispo", "dppo", "kl_cov", "vespo", "luspo"])
def test_on_policy_gradient_is_policy_gradient(name):
    # with r ≡ 1 every token-level objective's gradient is −Â ∇logp, aggregated by its mode (DPPO masks nothing,
    # KL-Cov's |logp − old_logp| has zero gradient at 0, VESPO's φ(1) = 1)
    lp, _, adv, mask = gspo_batch(seed=6)
    obj = get_objective(name)
    _, grad = grad_of(obj, lp, lp.detach(), adv, mask)
    per_token = -adv[:, None] * mask  # (B, T)
    lengths, B = mask.sum(1, keepdim=True), lp.shape[0]
    expected = {
        "token-mean": per_token / mask.sum(),
        "seq-mean-token-mean": per_token / lengths / B,
        "seq-mean-token-sum": per_token / B,  # LUSPO: GSPO's −Â/|y_i| per token, times |y_i|
        "seq-mean-token-sum-norm": per_token / (B * lp.shape[1]),
    }[obj.aggregation]
    torch.testing.assert_close(grad, expected)


# ---- KL ------------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 0.5]))
    # k3 = e^(ref−logp) − (ref−logp) − 1: e^−1 + 1 − 1 and e^1 − 1 − 1
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([math.exp(-1), math.e - 2]))
    x, y = torch.randn(1000) * 5, torch.randn(1000) * 5
    assert (kl_penalty(x, y, "k3") >= 0).all()
    assert kl_penalty(x, x, "k3").abs().max() == 0


def test_beta_adds_aggregated_kl():
    # on-policy with Â = 0 the policy part is 0: loss = β · seq-mean-token-mean(k3) for GRPO
    lp, _, _, mask = gspo_batch(seed=7)
    ref = lp - 0.5 * mask
    out = GRPO(beta=0.1)(lp, lp.detach(), torch.zeros(lp.shape[0]), mask, ref_logprobs=ref)
    k3 = math.exp(-0.5) + 0.5 - 1  # ref − logp = −0.5 on every valid token
    assert out.loss.item() == pytest.approx(0.1 * k3, rel=1e-5)
    assert out.metrics["kl"].item() == pytest.approx(k3, rel=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPO(beta=0.1)(lp, lp.detach(), torch.zeros(lp.shape[0]), mask)


# ---- registry and bad input ----------------------------------------------------------------------
def test_unknown_objective_lists_registered():
    with pytest.raises(ValueError) as err:
        get_objective("ppo2")
    for name in ALL:
        assert name in str(err.value)


def test_unknown_aggregation_and_kl_estimator_list_valid_ones():
    with pytest.raises(
        ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"
    ):
        GRPO(aggregation="mean")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        GSPO(kl_estimator="k4")


def test_mismatched_shapes_name_the_shapes():
    lp, old, adv, mask = gspo_batch()
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(5, 5\) but logprobs has \(5, 6\)"):
        GSPO()(lp, old[:, :5], adv, mask)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        GSPO()(lp, old, adv[:4], mask)
    with pytest.raises(ValueError, match=r"values has shape \(5, 2\)"):
        PPO()(lp, old, adv, mask, values=torch.zeros(5, 2), old_values=torch.zeros(5, 6), returns=torch.zeros(5, 6))


@pytest.mark.parametrize("key", ["logprobs", "old_logprobs", "advantages", "ref_logprobs"])
def test_non_finite_inside_mask_raises(key):
    lp, old, adv, mask = gspo_batch()
    tensors = {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": adv[:, None].expand_as(lp).clone(),
        "ref_logprobs": old.clone(),
    }
    tensors[key][2, 1] = float("nan")
    with pytest.raises(ValueError, match=rf"{key} has 1 non-finite value\(s\) inside the mask, first at .* \(2, 1\)"):
        GRPO(beta=0.1)(
            tensors["logprobs"],
            tensors["old_logprobs"],
            tensors["advantages"],
            mask,
            ref_logprobs=tensors["ref_logprobs"],
        )


def test_user_subclass_registers_and_is_found():
    class Reinforce(Objective):
        """Plain off-policy REINFORCE: ℓ_t = −r_t Â_t (a user's new algorithm in a few lines)."""

        name = "test_reinforce"

        def __init__(self, beta: float = 0.0, aggregation: Aggregation = "seq-mean-token-sum"):  # its defaults
            super().__init__(beta=beta, aggregation=aggregation)

        def policy_loss(self, logprobs, old_logprobs, advantages, mask, counts, **extra):
            from lit_gspo.rl.objectives import LossOutput, aggregate, token_ratio_metrics

            ratio = torch.exp(logprobs - old_logprobs)
            never = torch.zeros_like(mask)
            return LossOutput(
                aggregate(-ratio * advantages, mask, self.aggregation, counts),
                token_ratio_metrics(ratio, mask, never, never),
            )

    class _Helper(Objective, register=False):
        pass

    try:
        assert OBJECTIVES["test_reinforce"] is Reinforce
        assert "_helper" not in OBJECTIVES and "helper" not in OBJECTIVES
        obj = get_objective("test_reinforce", beta=0.2)
        assert isinstance(obj, Reinforce) and obj.beta == 0.2
        lp, old, adv, mask = gspo_batch()
        out = obj(lp, lp.detach(), adv, mask, ref_logprobs=old)
        # seq-mean-token-sum on-policy: −Σ_i Â_i |y_i| / N_seqs, plus β · Σ k3 / N_seqs
        kl = (kl_penalty(lp, old, "k3") * mask).sum() / 5
        assert out.loss.item() == pytest.approx((-(adv * mask.sum(1)).sum() / 5 + 0.2 * kl).item(), rel=1e-5)
    finally:
        OBJECTIVES.pop("test_reinforce", None)


def test_jsonargparse_builds_objectives_by_class_name():
    # LightningCLI picks an objective by class name and introspects its __init__ for hyperparameters
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--objective", type=Objective)
    cfg = parser.parse_args(["--objective", "DAPO", "--objective.dual_clip", "3", "--objective.beta", "0.01"])
    obj = parser.instantiate(cfg).objective
    assert isinstance(obj, DAPO) and (obj.dual_clip, obj.beta, obj.clip_high) == (3.0, 0.01, 0.28)
    cfg = parser.parse_args(["--objective", "GSPO", "--objective.clip_high", "5e-4"])
    assert parser.instantiate(cfg).objective.clip_high == 5e-4


def test_sapo_hand_values():
    # TOKEN_EXAMPLE: row 0 (Â=+1, τ=1): r 1.5, 0.9 → f = 4σ(0.5), 4σ(−0.1); row 1 (Â=−1, τ=1.05): r 0.5 →
    # f = (4/1.05)σ(−0.525). σ(0.5) = 0.622459, σ(−0.1) = 0.475021, σ(−0.525) = 0.371684.
    # ℓ: −2.489836, −1.900083 | +1.415938. seq-mean-token-mean: ((−2.489836 − 1.900083)/2 + 1.415947)/2
    lp, old, mask = ratio_batch(*TOKEN_EXAMPLE)
    out, grad = grad_of(SAPO(), lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx(((-2.489837 - 1.900083) / 2 + 1.415938) / 2, abs=1e-5)
    # ∂ℓ/∂logp = −4σ(1−σ)·r·Â, / |y_i| / N_seqs: row 0 t0 −4·0.622459·0.377541·1.5 / 4 = −0.352502,
    # t1 −4·0.475021·0.524979·0.9 / 4 = −0.224434; row 1 +4·0.371684·0.628316·0.5 / 2 = +0.233532
    torch.testing.assert_close(grad, torch.tensor([[-0.352502, -0.224434], [0.233532, 0.0]]), atol=1e-5, rtol=0)
    assert out.metrics["clip_frac"].item() == 0.0  # a soft gate never zeroes a gradient
    w = [4 * 0.622459 * 0.377541, 4 * 0.475021 * 0.524979, 4 * 0.371684 * 0.628316]
    assert out.metrics["gate_weight"].item() == pytest.approx(sum(w) / 3, abs=1e-5)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        SAPO(tau_neg=0.0)


def test_sapo_on_policy_gradient_is_the_policy_gradient_grpo_takes():
    """At r = 1 the gate's weight is exactly 1: SAPO's gradient equals GRPO's (same aggregation)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g) * 3
    adv, mask = torch.randn(4, generator=g), torch.rand(4, 6, generator=g) < 0.8
    sapo, sapo_grad = grad_of(SAPO(), lp, lp.clone(), adv, mask)
    grpo, grpo_grad = grad_of(GRPO(), lp, lp.clone(), adv, mask)
    torch.testing.assert_close(sapo_grad, grpo_grad, atol=1e-7, rtol=0)
    assert sapo.metrics["gate_weight"].item() == pytest.approx(1.0, abs=1e-6)
    far, far_grad = grad_of(SAPO(), lp, lp - 1.0, adv, mask)  # r = e: every token attenuated
    assert far.metrics["gate_weight"].item() < 0.6


# ---- objectives after GSPO: DPPO, Clip-Cov, KL-Cov, VESPO, LUSPO -----------------------------------
def prob_batch(new, old):
    """logprobs = log π, old_logprobs = log μ: the example reads as probabilities."""
    return torch.tensor(new).log(), torch.tensor(old).log()


# Â = [+1, −1]. row 0: μ 0.5 → π 0.7 (TV 0.2, up), μ 0.01 → π 0.1 (ratio 10, TV 0.09, up);
#               row 1: μ 0.9 → π 0.7 (TV 0.2, down), μ 0.5 → π 0.6 (up, the direction Â < 0 does not push)
DPPO_EXAMPLE = prob_batch([[0.7, 0.1], [0.7, 0.6]], [[0.5, 0.01], [0.9, 0.5]])


def test_dppo_binary_tv_hand_values():
    # δ = 0.15: row 0 t0 leaves the region upwards with Â > 0 → masked; row 0 t1 is kept (PPO would clip r = 10);
    # row 1 t0 leaves it downwards with Â < 0 → masked; row 1 t1 kept. ℓ = −M r Â: [0, −10 | 0, +1.2];
    # seq-mean-token-sum-norm: Σ / (N_seqs · L) = (−10 + 1.2) / 4; gradient −M r Â / 4
    lp, old = DPPO_EXAMPLE
    out, grad = grad_of(DPPO(), lp, old, ADV, torch.ones(2, 2))
    assert out.loss.item() == pytest.approx((-10 + 1.2) / 4, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2.5], [0.0, 0.3]]))
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(0.25)
    assert out.metrics["clip_frac_low"].item() == pytest.approx(0.25)
    assert out.metrics["divergence_mean"].item() == pytest.approx((0.2 + 0.09 + 0.2 + 0.1) / 4, abs=1e-6)
    assert out.metrics["ratio_max"].item() == pytest.approx(10.0, rel=1e-5)
    # ratio_cap C = 5: value and gradient of the kept rare token use min(r, C) = 5
    capped, capped_grad = grad_of(DPPO(ratio_cap=5.0), lp, old, ADV, torch.ones(2, 2))
    assert capped.loss.item() == pytest.approx((-5 + 1.2) / 4, abs=1e-5)
    torch.testing.assert_close(capped_grad, torch.tensor([[0.0, -1.25], [0.0, 0.3]]))


def test_dppo_binary_kl_hand_values():
    # KL(μ‖π) = μ log(μ/π) + (1 − μ) log((1 − μ)/(1 − π)), δ = 0.05: the rare token's move 0.01 → 0.1 is now
    # outside too (0.0713); only row 1 t1 (pushed the other way) keeps its gradient: ℓ = +1.2, / 4
    kl = lambda m, p: m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))  # noqa: E731
    lp, old = DPPO_EXAMPLE
    out, grad = grad_of(DPPO(divergence="binary_kl"), lp, old, ADV, torch.ones(2, 2))
    assert (out.metrics["clip_frac"].item(), out.metrics["clip_frac_high"].item()) == pytest.approx((0.75, 0.5))
    assert out.loss.item() == pytest.approx(1.2 / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [0.0, 0.3]]))
    expected = (kl(0.5, 0.7) + kl(0.01, 0.1) + kl(0.9, 0.7) + kl(0.5, 0.6)) / 4
    assert out.metrics["divergence_mean"].item() == pytest.approx(expected, rel=1e-5)
    assert (
        DPPO(divergence="binary_kl").clip_low == 0.05 and DPPO(divergence="binary_kl", clip_high=0.1).clip_high == 0.1
    )
    with pytest.raises(ValueError, match="binary_tv, binary_kl"):
        DPPO(divergence="tv")
    with pytest.raises(ValueError, match="ratio_cap"):
        DPPO(ratio_cap=0.0)


def test_dppo_binary_kl_is_finite_at_certain_tokens():
    # μ = 1 (old log-prob 0) and π = 1: 0·log 0 terms must give 0, not NaN
    lp, old = torch.tensor([[0.0, -1e-9, -5.0]]), torch.tensor([[0.0, 0.0, 0.0]])
    out, grad = grad_of(DPPO(divergence="binary_kl"), lp, old, torch.tensor([-1.0]), torch.ones(1, 3))
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 3)  # 1 → e^−5 with Â < 0: far outside


# Covariance example: Â = [+2, −2] (mean 0), logp [[−0.5, −3], [−0.5, −1.5]] (mean −1.375):
#   c = [[2·0.875, 2·(−1.625)], [−2·0.875, −2·(−0.125)]] = [[1.75, −3.25], [−1.75, 0.25]]; only c_00 is in (1, 5)
COV_LP = torch.tensor([[-0.5, -3.0], [-0.5, -1.5]])
COV_ADV = torch.tensor([2.0, -2.0])


def test_clip_cov_hand_values():
    # on-policy: PPO's ℓ = −Â per token, token-mean value (−2 − 2 + 2 + 2)/4 = 0 (detaching keeps the value);
    # N = 4 → ⌊2e-4 · 4⌋ → 1 token drawn from the one candidate (0, 0): its gradient −Â/4 becomes 0
    out, grad = grad_of(ClipCov(), COV_LP, COV_LP.clone(), COV_ADV, torch.ones(2, 2))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5], [0.5, 0.5]]))
    assert out.metrics["clip_frac"].item() == out.metrics["cov_clip_frac"].item() == pytest.approx(0.25)
    assert out.metrics["cov_mean"].item() == pytest.approx((1.75 - 3.25 - 1.75 + 0.25) / 4)
    # a larger share draws no more than the candidates there are
    _, more = grad_of(ClipCov(clip_cov_ratio=0.5), COV_LP, COV_LP.clone(), COV_ADV, torch.ones(2, 2))
    torch.testing.assert_close(more, grad)
    # a token PPO already clips (r = 1.5 > 1.2 with Â > 0) is no candidate: nothing else is drawn
    old = COV_LP - torch.tensor([[math.log(1.5), 0.0], [0.0, 0.0]])
    clipped, clipped_grad = grad_of(ClipCov(), COV_LP, old, COV_ADV, torch.ones(2, 2))
    assert clipped.metrics["cov_clip_frac"].item() == 0.0 and clipped.metrics["clip_frac"].item() == pytest.approx(0.25)
    torch.testing.assert_close(clipped_grad, torch.tensor([[0.0, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        ClipCov(clip_cov_lb=5.0, clip_cov_ub=1.0)


def test_clip_cov_draws_uniformly_among_candidates():
    # two candidates (c = 2.5 each), one drawn: either may be, never another token
    lp = torch.tensor([[-0.5, -3.0], [-0.5, -3.0]])
    adv = torch.tensor([2.0, -2.0])  # c = [[2.5, −2.5], [−2.5, 2.5]]
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        _, grad = grad_of(ClipCov(), lp, lp.clone(), adv, torch.ones(2, 2))
        zeroed = tuple((grad == 0).flatten().tolist())
        assert zeroed in {(True, False, False, False), (False, False, False, True)}
        seen.add(zeroed)
    assert len(seen) == 2


def test_kl_cov_hand_values():
    # ⌊2e-3 · 4⌋ → 1 token, the largest c: (0, 0), whose log-ratio is 0.1. No clip anywhere:
    # ℓ = −r Â + |Δ| there: −2e^0.1 + 0.1; elsewhere −Â: −2, +2, +2. token-mean over 4.
    # gradient: (−2e^0.1 + 1)/4 at (0, 0) (d|Δ|/dlogp = 1), −Â/4 elsewhere
    old = COV_LP - torch.tensor([[0.1, 0.0], [0.0, 0.0]])
    out, grad = grad_of(KLCov(), COV_LP, old, COV_ADV, torch.ones(2, 2))
    assert out.loss.item() == pytest.approx((-2 * math.exp(0.1) + 0.1 - 2 + 2 + 2) / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[(-2 * math.exp(0.1) + 1) / 4, -0.5], [0.5, 0.5]]))
    assert out.metrics["kl_cov_frac"].item() == pytest.approx(0.25)
    assert out.metrics["clip_frac"].item() == 0.0
    # k = 0.5: the two largest c, (0, 0) and (1, 1); (1, 1) is on-policy, so its penalty adds nothing
    both = KLCov(kl_cov_ratio=0.5)(COV_LP, old, COV_ADV, torch.ones(2, 2))
    assert both.metrics["kl_cov_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        KLCov(kl_cov_ratio=0.0)


def test_vespo_hand_values():
    # row 0 (Â = +1, k 2, λ 3): ratios 2 and 0.75 → W = 1.5 (the product), φ = 1.5² e^{3(1 − 1.5)} = 0.502043
    # row 1 (Â = −1, k 3, λ 2): one valid token, ratio 0.5 → W = 0.5, φ = 0.5³ e^{2(1 − 0.5)} = 0.339785
    # ℓ = −φ Â logp with logp [[−1, −2], [−0.5, pad]]: 0.502043, 1.004086, −0.169893 → token-mean over 3
    phi0, phi1 = 2.25 * math.exp(-1.5), 0.125 * math.e
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old = lp - torch.tensor([[math.log(2.0), math.log(0.75)], [math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out, grad = grad_of(VESPO(), lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx((phi0 * 1 + phi0 * 2 - phi1 * 0.5) / 3, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0.0]]))  # −φ Â / 3
    assert out.metrics["gate_weight"].item() == pytest.approx((2 * phi0 + phi1) / 3, abs=1e-6)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5, rel=1e-5)
    assert out.metrics["ratio_min"].item() == pytest.approx(0.5, rel=1e-5)
    assert out.metrics["clip_frac"].item() == 0.0


def test_vespo_kernel_shape():
    # φ(1) = 1; the peak φ(k/λ) = (k/λ)^k e^{λ − k} exceeds 1; a weight of e^20 underflows φ to 0 (clip_frac)
    lp = torch.tensor([[-1.0]])
    one = VESPO()(lp, lp.clone(), torch.ones(1), torch.ones(1, 1))
    assert one.metrics["gate_weight"].item() == 1.0
    peak = VESPO()(lp, lp - math.log(2 / 3), torch.ones(1), torch.ones(1, 1))
    assert peak.metrics["gate_weight"].item() == pytest.approx((2 / 3) ** 2 * math.e, rel=1e-5)
    far, grad = grad_of(VESPO(), lp, lp - 20.0, torch.ones(1), torch.ones(1, 1))
    assert far.metrics["clip_frac"].item() == 1.0 and far.metrics["clip_frac_high"].item() == 1.0
    assert grad.item() == 0.0
    with pytest.raises(ValueError, match="lambda_pos and lambda_neg > 0"):
        VESPO(lambda_neg=0.0)


def test_luspo_is_gspo_weighted_by_length():
    # band 0.5: row 0 s = √2 (unclipped), |y| 2 → |y| ℓ = −2√2; row 1 s = 0.9, Â = −1 → 0.9. loss = Σ / N_seqs.
    # gradient: |y_i| · (−s_i Â_i / |y_i|) / N_seqs = −s_i Â_i / 2 per token: twice GSPO's on the 2-token row
    lp, old, mask = ratio_batch([[2.0, 1.0], [0.9, 1.0]], [[1, 1], [1, 0]])
    out, grad = grad_of(LUSPO(clip_low=0.5, clip_high=0.5), lp, old, ADV, mask)
    assert out.loss.item() == pytest.approx((-2 * math.sqrt(2) + 0.9) / 2, abs=1e-6)
    s = math.sqrt(2)
    torch.testing.assert_close(grad, torch.tensor([[-s / 2, -s / 2], [0.45, 0.0]]))
    _, gspo_grad = grad_of(GSPO(clip_low=0.5, clip_high=0.5), lp, old, ADV, mask)
    torch.testing.assert_close(grad[0], 2 * gspo_grad[0])
    # LUSPO is an aggregation of GSPO: identical loss, gradient and metrics on any batch
    lp, old, adv, mask = gspo_batch(seed=2, scale=3e-2)
    a, ga = grad_of(LUSPO(), lp, old, adv, mask)
    b, gb = grad_of(GSPO(clip_low=2e-3, clip_high=2.5e-3, aggregation="seq-mean-token-sum"), lp, old, adv, mask)
    assert 0 < a.metrics["clip_frac"].item() < 1
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(ga, gb)
    assert a.metrics.keys() == b.metrics.keys() and all(torch.equal(a.metrics[k], b.metrics[k]) for k in a.metrics)


def test_a_second_class_under_a_taken_name_is_refused_naming_both():
    """A subclass that reuses a registered name would silently replace the built-in (verl's registry raises too)."""
    with pytest.raises(
        ValueError,
        match=r"objective name 'gspo' is taken by lit_gspo\.rl\.objectives\.gspo\.GSPO; "
        r".*\.Impostor cannot register under it",
    ):

        class Impostor(Objective):
            name = "gspo"

    assert OBJECTIVES["gspo"] is GSPO
    with pytest.raises(ValueError, match=r"advantage estimator name 'rloo' is taken by lit_gspo\.rl\.advantages\.RLOO"):
        from lit_gspo.rl.advantages import AdvantageEstimator

        class MyRLOO(AdvantageEstimator):
            name = "rloo"


def test_a_subclass_without_a_name_registers_under_its_own_and_a_redefinition_replaces_itself():
    from lit_gspo.rl.advantages import ADVANTAGES, RLOO

    namespace: dict = {}
    source = "from lit_gspo.rl.advantages import RLOO\nclass ScaledRLOO(RLOO):\n    pass\n"
    exec(compile(source, "user_module", "exec"), namespace)
    first = ADVANTAGES.pop("scaled_rloo")  # a subclass of a built-in no longer takes the built-in's name
    assert first.__name__ == "ScaledRLOO" and ADVANTAGES["rloo"] is RLOO
    exec(compile(source, "user_module", "exec"), namespace)  # the same class defined again (a reloaded module)
    exec(compile(source, "user_module", "exec"), namespace)
    assert ADVANTAGES.pop("scaled_rloo").__name__ == "ScaledRLOO"


def test_k3_is_gives_the_reverse_kls_exact_gradient_on_policy_and_k3_does_not():
    """E_{y~π}[∇ (π_θ/π_old)(y) · k3(y)] at θ = θ_old is ∇ KL(π_θ ‖ π_ref) (DeepSeek-V3.2's unbiased estimate, TRL's
    use_bias_correction_kl); E_{y~π}[∇ k3(y)] alone is not. Exact expectations over a 5-token vocabulary."""
    from lit_gspo.rl.objectives.base import kl_penalty

    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(5, dtype=torch.float64).log_softmax(0)
    logp = theta.log_softmax(0)
    exact = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]
    probs = logp.detach().exp()

    def expected_gradient(estimator):
        logp = theta.log_softmax(0)
        per_token = kl_penalty(logp, ref, estimator, old_logprobs=logp.detach())
        return torch.autograd.grad((probs * per_token).sum(), theta)[0]

    torch.testing.assert_close(expected_gradient("k3_is"), exact)
    assert (expected_gradient("k3") - exact).abs().max() > 1e-2
    value = (probs * kl_penalty(logp.detach(), ref, "k3_is", old_logprobs=logp.detach())).sum()
    torch.testing.assert_close(value, (probs * (logp.detach() - ref)).sum())  # on-policy: E[k3] = KL
