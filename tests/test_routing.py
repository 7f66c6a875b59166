"""Routing Replay on the tiny Qwen3-MoE: record, replay exactly, volatility, gradient to the router."""

import pytest
import torch

from lit_gspo.models import load_policy
from lit_gspo.models.routing import (
    RoutingRecord,
    changed_slots,
    moe_routers,
    record_routing,
    replay_routing,
    rerouted_tokens,
    routing_volatility,
)


@pytest.fixture(scope="module")
def moe():
    model, tok = load_policy("tiny-qwen3-moe", seed=0)
    batch = tok(["12+34=46", "7*8=56", "hello"], return_tensors="pt", padding=True)
    return model.eval(), batch


def token_logprobs(model, batch):
    logits = model(**batch).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


class ExpertInputs:
    """Capture the expert indices each MoE block actually hands to its experts."""

    def __init__(self, model):
        self.blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
        self.seen: list[torch.Tensor] = []

    def __enter__(self):
        self.handles = [
            b.register_forward_pre_hook(lambda mod, args: self.seen.append(args[1].clone())) for b in self.blocks
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def perturb_routers(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=g))


def test_routers_found_and_record_shapes(moe):
    model, batch = moe
    routers = moe_routers(model)
    assert len(routers) == model.config.num_hidden_layers
    assert moe_routers(load_policy("tiny-llama")[0]) == []
    with record_routing(model) as rec, torch.no_grad():
        model(**batch)
    B, T = batch.input_ids.shape
    assert len(rec.calls) == 1
    assert rec.record.shape == (B, T, model.config.num_experts_per_tok)
    assert rec.record.num_layers == len(routers)


def copy_of(model):
    """A copy to perturb, leaving the module-scoped fixture's weights alone."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def test_replay_uses_recorded_experts_and_is_exact(moe):
    model, batch = copy_of(moe[0]), moe[1]
    with record_routing(model) as old, torch.no_grad():
        ref = token_logprobs(model, batch)
    recorded = [i.reshape(-1, i.shape[-1]) for i in old.record.indices]
    saved = [r.weight.detach().clone() for r in moe_routers(model)]
    perturb_routers(model)
    with record_routing(model) as free, ExpertInputs(model) as free_seen, torch.no_grad():
        model(**batch)
    assert routing_volatility(old.record, free.record) > 0  # without replay the new router picks other experts
    assert any(not torch.equal(idx, rec) for idx, rec in zip(free_seen.seen, recorded))
    with replay_routing(model, old.record), ExpertInputs(model) as seen, torch.no_grad():
        model(**batch)
    assert len(seen.seen) == len(recorded)
    for idx, rec in zip(seen.seen, recorded):  # with replay the experts get the recorded choices
        assert torch.equal(idx, rec)
    with torch.no_grad():
        for router, weight in zip(moe_routers(model), saved):
            router.weight.copy_(weight)
    with replay_routing(model, old.record), torch.no_grad():
        out = token_logprobs(model, batch)
    assert torch.equal(out, ref)  # the recomputed routing weights are the recorded pass's, bit for bit


def test_volatility_zero_without_change(moe):
    model, batch = moe
    with record_routing(model) as rec, torch.no_grad():
        model(**batch)
        model(**batch)
    first, second = rec.calls
    assert routing_volatility(first, second) == 0.0


def test_perturbed_router_changes_choices_and_the_mask_restricts_the_count(moe):
    model, batch = copy_of(moe[0]), moe[1]
    with record_routing(model) as old, torch.no_grad():
        model(**batch)
    perturb_routers(model)
    with record_routing(model) as new, torch.no_grad():
        model(**batch)
    vol = routing_volatility(old.record, new.record)
    assert 0.0 < vol <= 1.0
    # masking out everything but one row restricts the count to it
    mask = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    mask[0] = True
    assert routing_volatility(old.record, new.record, mask) == pytest.approx(
        routing_volatility(old.record[0], new.record[0])
    )


def test_gradient_reaches_router_under_replay(moe):
    model, batch = moe
    with record_routing(model) as rec, torch.no_grad():
        model(**batch)
    model.zero_grad()
    with replay_routing(model, rec.record):
        token_logprobs(model, batch).sum().backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_record_slicing_and_cat_match_chunked_passes(moe):
    model, batch = moe
    with record_routing(model) as rec, torch.no_grad():
        model(input_ids=batch.input_ids[:2], attention_mask=batch.attention_mask[:2])
        model(input_ids=batch.input_ids[2:], attention_mask=batch.attention_mask[2:])
    with record_routing(model) as whole, torch.no_grad():
        model(**batch)
    assert routing_volatility(rec.record, whole.record) == 0.0
    rows = torch.tensor([2, 0])
    sub = whole.record[rows]
    with replay_routing(model, sub), torch.no_grad():
        model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows])
    with pytest.raises(ValueError, match="do not match"), replay_routing(model, sub), torch.no_grad():
        model(**batch)


def test_volatility_ignores_slot_order():
    a = RoutingRecord([torch.tensor([[[1, 4], [0, 2]]])])
    b = RoutingRecord([torch.tensor([[[4, 1], [2, 3]]])])
    assert routing_volatility(a, b) == pytest.approx(1 / 4)


def test_replay_with_gradient_checkpointing_backward_inside():
    from lit_gspo.models import enable_gradient_checkpointing

    model, tok = load_policy("tiny-qwen3-moe", seed=0)
    batch = tok(["12+34=46", "7*8=56"], return_tensors="pt", padding=True)
    with record_routing(model) as rec, torch.no_grad():
        ref = token_logprobs(model.eval(), batch)
    perturb_routers(model)
    enable_gradient_checkpointing(model)
    model.train()
    with replay_routing(model, rec.record), ExpertInputs(model) as seen:
        lp = token_logprobs(model, batch)
        lp.sum().backward()
    recorded = [i.reshape(-1, i.shape[-1]) for i in rec.record.indices]
    assert len(seen.seen) == 2 * len(recorded)  # forward + recomputation in backward
    forward, recomputed = seen.seen[: len(recorded)], seen.seen[len(recorded) :]
    for idx, rec_idx in zip(forward, recorded):
        assert torch.equal(idx, rec_idx)
    for idx, rec_idx in zip(recomputed, reversed(recorded)):  # backward recomputes the last layer first
        assert torch.equal(idx, rec_idx)
    assert all(r.weight.grad is not None for r in moe_routers(model))
    assert lp.shape == ref.shape


def test_changed_slots_compare_expert_sets_and_rerouted_tokens_any_layer():
    # 1 sequence, 3 positions, k = 2, two layers
    layer0_old = torch.tensor([[[1, 4], [0, 2], [3, 5]]])
    layer0_new = torch.tensor([[[4, 2], [2, 0], [3, 5]]])  # {1,4}→{4,2}: 1 slot; {0,2}→{2,0}: same set
    layer1_old = torch.tensor([[[0, 1], [0, 1], [0, 1]]])
    layer1_new = torch.tensor([[[0, 1], [0, 1], [6, 7]]])  # position 2: both slots
    before, after = RoutingRecord([layer0_old, layer1_old]), RoutingRecord([layer0_new, layer1_new])
    assert [c.tolist() for c in changed_slots(before, after)] == [[[1, 0, 0]], [[0, 0, 2]]]
    assert rerouted_tokens(before, after).tolist() == [[True, False, True]]
    assert routing_volatility(before, after) == pytest.approx(3 / 12)
    assert routing_volatility(before, after, torch.tensor([[1, 1, 0]])) == pytest.approx(1 / 8)
