"""MoE inside the trainer: Routing Replay in the update forward, and train/routing_volatility."""

import sys
from pathlib import Path

import pytest
import torch

from lit_gspo.lightning.module import RLModule
from lit_gspo.models.routing import moe_routers, record_routing
from lit_gspo.rl.config import Generation, Policy, Routing, Update
from lit_gspo.rl.learn.hooks import RoutingReplay
from lit_gspo.rl.objectives import GRPO
from lit_gspo.rl.rewards import CharAccuracy
from lit_gspo.rl.rollout import token_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import column, read_metrics, tiny_args  # noqa: E402

# prompts of different lengths, so a micro-batch of short prompts is trimmed differently from the rollout
ROWS = [
    {"prompt": "rev 12=", "answer": "21"},
    {"prompt": "rev 1234567=", "answer": "7654321"},
    {"prompt": "rev 345=", "answer": "543"},
    {"prompt": "rev 98765=", "answer": "56789"},
]


class ExpertInputs:
    """The top-k indices each Qwen3-MoE experts module actually receives, per forward pass."""

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


def moe_module(**kwargs) -> RLModule:
    kwargs = (
        dict(
            policy=Policy("tiny-qwen3-moe", kl_to_ref=False),
            objective=GRPO(),
            rewards=[CharAccuracy()],
            generation=Generation(num_generations=3, max_new_tokens=5),
            update=Update(num_minibatches=2, micro_batch_size=4),
        )
        | kwargs
    )
    return RLModule(**kwargs)


def snapshot_rollout(module: RLModule):
    torch.manual_seed(0)
    rollout, _, _ = module.collector.sample(module.policy, ROWS)
    rollout = rollout.trimmed()
    module.learner.snapshot(rollout)
    return rollout


def perturb_routers(model, scale=1.0):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=g))


@pytest.fixture(scope="module")
def replay():
    module = moe_module(policy=Policy("tiny-qwen3-moe", kl_to_ref=False, routing=Routing(replay=True)))
    return module, snapshot_rollout(module)


def test_the_old_pass_records_routing_over_the_whole_rollout(replay):
    module, rollout = replay
    k, layers = module.policy.config.num_experts_per_tok, module.policy.config.num_hidden_layers
    assert rollout.routing.num_layers == layers
    assert rollout.routing.shape == (*rollout.input_ids.shape, k)  # (N, P + T, k), joined over micro-batches
    assert rollout.old_logprobs is not None


def test_replay_uses_the_recorded_experts_and_reproduces_old_logprobs(replay):
    module, rollout = replay
    rows = torch.tensor([0, 6, 7, 8])  # prompts 0 and 2 are the shortest: trimming drops prompt padding
    micro = rollout.select(rows).trimmed()
    assert micro.prompt_length < rollout.prompt_length
    with torch.no_grad(), ExpertInputs(module.policy) as experts, RoutingReplay(module.policy).around_micro(micro):
        logp = token_logprobs(module.policy, micro, temperature=module.generation.temperature).logprobs
    for layer, used in enumerate(experts.seen):
        assert torch.equal(used, micro.routing.indices[layer].reshape(used.shape))
    T = micro.completion_mask.shape[1]
    mask = micro.completion_mask
    old = rollout.old_logprobs[rows][:, :T]
    torch.testing.assert_close(logp[mask], old[mask], rtol=0, atol=1e-5)


def test_replay_pins_the_experts_after_the_router_moved():
    module = moe_module(policy=Policy("tiny-qwen3-moe", kl_to_ref=False, routing=Routing(replay=True)))
    rollout = snapshot_rollout(module)
    perturb_routers(module.policy, scale=2.0)
    micro = rollout.select(torch.arange(len(rollout))).trimmed()
    with torch.no_grad(), ExpertInputs(module.policy) as free:
        token_logprobs(module.policy, micro)
    with torch.no_grad(), ExpertInputs(module.policy) as pinned, RoutingReplay(module.policy).around_micro(micro):
        token_logprobs(module.policy, micro)
    recorded = [t.reshape(-1, t.shape[-1]) for t in micro.routing.indices]
    assert any(not torch.equal(a, b) for a, b in zip(free.seen, recorded))
    assert all(torch.equal(a, b) for a, b in zip(pinned.seen, recorded))


def test_volatility_is_zero_before_an_update_and_positive_after_the_router_moved():
    module = moe_module(update=Update())  # no replay: volatility tracking alone records the old pass, even on-policy
    rollout = snapshot_rollout(module)
    assert rollout.routing is not None and rollout.old_logprobs is None
    assert module.learner.measure_routing(rollout)["routing_volatility"] == 0.0
    perturb_routers(module.policy, scale=2.0)
    assert 0.0 < module.learner.measure_routing(rollout)["routing_volatility"] <= 1.0


@pytest.mark.parametrize("budget", [None, 48], ids=["rows in order", "a token budget deals rows by length"])
def test_rerouted_and_kept_tokens_split_the_log_ratio_by_whether_an_expert_changed(budget):
    """With a token budget (on a GPU, by default) the micro-batches take rows longest first: before, the measure
    compared the passes' rows in that order with the rollout's in its own, i.e. other rows' experts and log-probs."""
    module = moe_module(update=Update(num_minibatches=2, micro_batch_size=4, micro_batch_tokens=budget))
    rollout = snapshot_rollout(module)
    assert rollout.old_logprobs is not None
    before = module.learner.measure_routing(rollout)
    assert before["routing/rerouted_tokens"] == 0.0 and before["routing/abs_logratio_kept"] == 0.0
    assert before["routing/abs_logratio_rerouted"] != before["routing/abs_logratio_rerouted"]  # NaN: none rerouted
    perturb_routers(module.policy, scale=0.005)  # router weights have std 0.02: some tokens keep their experts
    after = module.learner.measure_routing(rollout)
    # by hand: the perturbed policy's experts and log-probs on the whole rollout, against the snapshot's
    with torch.no_grad(), record_routing(module.policy) as rec:
        logprobs = token_logprobs(module.policy, rollout).logprobs
    P, mask = rollout.prompt_length, rollout.completion_mask.bool()
    rerouted = torch.zeros_like(mask)
    for old, new in zip(rollout.routing.indices, rec.record.indices):
        for b, t in mask.nonzero().tolist():
            rerouted[b, t] |= set(old[b, P + t].tolist()) != set(new[b, P + t].tolist())
    shift = (logprobs - rollout.old_logprobs).abs()
    assert 0 < rerouted.sum() < mask.sum()
    assert after["routing/rerouted_tokens"] == pytest.approx(float(rerouted.sum() / mask.sum()))
    # the learner's forward runs in micro-batches of 4 rows, this one in one batch: equal up to float rounding
    assert after["routing/abs_logratio_rerouted"] == pytest.approx(float(shift[rerouted].mean()), rel=1e-4)
    assert after["routing/abs_logratio_kept"] == pytest.approx(float(shift[mask & ~rerouted].mean()), rel=1e-4)


def test_routing_replay_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="routing.replay needs an MoE"):
        RLModule(policy=Policy("tiny-llama", routing=Routing(replay=True)))


def first_char_parity(prompts, completions, **columns):
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]


def test_fit_logs_routing_volatility_for_moe_and_moves_the_router(tmp_path):
    """A high learning rate moves the routers within one step: volatility > 0, with and without replay."""
    args = tiny_args(
        tmp_path,
        "--model.policy.name",
        "tiny-qwen3-moe",
        "--model.policy.config",
        "{}",
        "--trainer.max_steps",
        "2",
        "--model.optimizer.lr",
        "0.05",
        "--model.objective",
        "GRPO",
        "--model.update.num_minibatches",
        "2",
        "--model.policy.routing.replay",
        "true",
        "--model.validation.every_n_steps",
        "0",
    )
    from lit_gspo.tools.main import cli_main

    cli = cli_main(args, run=False)
    cli.model.collector.rewards.functions[0] = first_char_parity  # varies even for a random policy: non-zero advantages
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = read_metrics(tmp_path)
    assert max(column(rows, "train/grad_norm")) > 0
    vol = column(rows, "train/routing_volatility")
    assert len(vol) == 2 and all(0.0 <= v <= 1.0 for v in vol)  # 2 RL steps × 2 optimiser steps
    assert max(vol) > 0.0, vol
    assert column(rows, "train/ratio/seq_logratio_std")  # off-policy ratio diagnostics logged too


def test_dense_models_log_no_routing_volatility(tmp_path):
    from lit_gspo.tools.main import cli_main

    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "1", "--model.validation.every_n_steps", "0"), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "train/routing_volatility" not in read_metrics(tmp_path)[0]


def test_under_fsdp2_the_moe_learner_trains_the_shards_after_its_routing_passes():
    """FSDP2 keeps the root's parameters (embeddings, LM head) gathered after a forward, for its backward; after a
    no-grad forward nothing reshards them, and ``parameters()`` then names the gathered copies. Before, the snapshot's
    recorded old pass and the routing measure after the update left them so: an optimiser built after the snapshot
    stepped the copies and the shards of the (tied) embeddings were never trained, and reading them once freed crashed
    the process. Now the learner reshards after its no-grad passes: one process, sharded, learns the plain weights."""
    import torch.distributed as dist
    from test_learner import MAX_NEW, make_learner, sample_rollout, with_rewards
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gspo.models import load_policy
    from lit_gspo.rl.learn.learner import Learner
    from lit_gspo.rl.objectives import GSPO
    from lit_gspo.runtime.sharding import full_state_dict, shard_model

    rollout = sample_rollout(make_learner(Update()).policy)
    rewards = [0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        weights = []
        for shard in (False, True):
            policy, _ = load_policy("tiny-qwen3-moe", seed=0)
            learner = Learner(
                policy, GSPO(), Update(epochs=2, micro_batch_size=4), max_len=MAX_NEW, group_size=3, record_routing=True
            )
            if shard:
                shard_model(policy, init_device_mesh("cpu", (1,)))
            batch = with_rewards(learner, rollout, rewards)  # the snapshot records the old pass's experts
            assert all(type(p).__name__ == "DTensor" for p in policy.parameters()) == shard
            torch.manual_seed(1)
            metrics = learner.learn(batch, torch.optim.SGD(policy.parameters(), lr=0.5))
            assert 0 < metrics["routing_volatility"] <= 1  # measured after the update
            assert all(type(p).__name__ == "DTensor" for p in policy.parameters()) == shard
            weights.append(full_state_dict(policy) if shard else policy.state_dict())
    finally:
        dist.destroy_process_group()
    plain, sharded = weights
    assert not torch.equal(
        plain["model.embed_tokens.weight"],
        load_policy("tiny-qwen3-moe", seed=0)[0].state_dict()["model.embed_tokens.weight"],
    )
    for name in plain:
        torch.testing.assert_close(sharded[name], plain[name], atol=1e-5, rtol=0, msg=name)
