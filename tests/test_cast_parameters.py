"""``update.param_dtype``: the update's passes read bf16 casts of the fp32 parameters, cast once per optimiser step;
the gradients reach the fp32 master weights summed in fp32."""

import copy

import pytest
import torch
from test_learner import MAX_NEW, G, make_learner, plain_and_sharded_updates, sample_rollout, with_rewards
from torch.utils._python_dispatch import TorchDispatchMode

from lit_gspo.models.cast_parameters import CastParameters
from lit_gspo.rl.config import Update
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.learn.hooks import UpdateHook
from lit_gspo.rl.learn.learner import Learner

REWARDS = [0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
UPDATE = dict(num_minibatches=2, micro_batch_size=2, share_prompt_forward=False, max_grad_norm=None)


def test_an_update_on_bf16_casts_is_a_bf16_models_update_with_fp32_gradients_summed_into_fp32_weights():
    """The expectation built by hand: a copy of the policy whose parameters are bf16, run by a plain learner whose
    backward moves each micro-batch's bf16 gradient into an fp32 sum, and whose step applies SGD to fp32 master copies
    and casts them back. The cast learner's fp32 parameters, loss and clip fraction are those, bit for bit."""
    lr = 0.5
    cast = make_learner(Update(**UPDATE, param_dtype="bf16"))
    master = copy.deepcopy(cast.policy)
    model = copy.deepcopy(cast.policy)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    plain = Learner(model, cast.objective, Update(**UPDATE), max_len=MAX_NEW, group_size=G)
    pairs = list(zip(model.parameters(), master.parameters()))
    sums = [torch.zeros_like(m) for m in master.parameters()]

    def backward(loss):
        loss.backward()
        for (p, _), s in zip(pairs, sums):
            s += p.grad.float()
            p.grad = None

    def step(optimizer, clip, may_step):
        with torch.no_grad():
            for (p, m), s in zip(pairs, sums):
                m -= lr * s
                p.copy_(m)
                s.zero_()
        return 0.0

    rollout = sample_rollout(cast.policy)
    for rewards in (REWARDS, REWARDS[::-1]):  # two updates: the second from weights the first moved
        torch.manual_seed(1)
        got = cast.learn(with_rewards(cast, rollout, rewards), torch.optim.SGD(cast.policy.parameters(), lr=lr))
        torch.manual_seed(1)
        want = plain.learn(with_rewards(plain, rollout, rewards), torch.optim.SGD(model.parameters(), lr=lr),
                           backward=backward, step=step)  # fmt: skip
        assert got["loss"] == want["loss"] and got["clip_frac"] == want["clip_frac"]
        assert got["clip_frac"] > 0  # the second minibatch's ratios moved
        for (name, p), m in zip(cast.policy.named_parameters(), master.parameters()):
            assert p.dtype == torch.float32 and torch.equal(p, m), name


class ParameterCasts(TorchDispatchMode):
    """Counts the casts whose input is one of ``params``."""

    def __init__(self, params):
        super().__init__()
        self.pointers, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
def test_under_lightnings_autocast_each_parameter_is_cast_once_per_pass_not_once_per_micro_batch(param_dtype):
    """Lightning's bf16-mixed autocast has no cast cache: a Linear's weight is cast at every call, so the casts grow with
    the micro-batches. Cast parameters are cast once for the old-policy pass and once per optimiser step, whatever the
    micro-batches: every floating parameter (norms and embedding too, which autocast leaves in fp32)."""
    counts = {}
    for micro_batch_size in (1, None):  # one row per micro-batch, or one micro-batch per minibatch
        learner = make_learner(Update(**{**UPDATE, "micro_batch_size": micro_batch_size}, param_dtype=param_dtype))
        rollout = sample_rollout(learner.policy)
        params = list(learner.policy.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning enters it
            rollout = with_rewards(learner, rollout, REWARDS)
            with ParameterCasts(params) as casts:
                torch.manual_seed(1)
                learner.learn(rollout, torch.optim.SGD(params, lr=0.1))
        counts[micro_batch_size] = casts.count
    if param_dtype is None:
        assert counts[1] > 2 * counts[None]
    else:  # the second minibatch's old-policy pass, then the two steps
        assert counts[1] == counts[None] == 3 * len(params)


def test_the_parameters_come_back_as_they_were_and_tied_ones_share_one_cast():
    learner = make_learner(Update(param_dtype="bf16"))
    policy = learner.policy
    head, embedding = policy.get_output_embeddings(), policy.get_input_embeddings()
    assert head.weight is embedding.weight  # tiny-llama ties its LM head
    before = list(policy.named_parameters())
    keys, flags = list(policy.state_dict()), [p.requires_grad for _, p in before]
    embedding.weight.requires_grad_(False)  # a frozen parameter is read in bf16 too, without a gradient
    cast = CastParameters(torch.bfloat16)
    with pytest.raises(RuntimeError, match="inside"), cast.active(policy):
        assert head.weight is embedding.weight and head.weight.dtype == torch.bfloat16
        assert not embedding.weight.requires_grad and policy.model.norm.weight.requires_grad
        assert [p for _, p in policy.named_parameters()] == [p for _, p in before]  # registered as they were
        with cast.active(policy):  # nested: nothing more to cast
            assert policy.model.norm.weight.dtype == torch.bfloat16
        assert policy.model.norm.weight.dtype == torch.bfloat16
        raise RuntimeError("inside")  # an error inside puts them back too
    embedding.weight.requires_grad_(True)
    after = list(policy.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert list(policy.state_dict()) == keys and [p.requires_grad for _, p in after] == flags
    assert all(p.dtype == torch.float32 for _, p in after) and head.weight is embedding.weight


def test_param_dtype_names_the_value_and_what_is_valid():
    with pytest.raises(ValueError, match=r"param_dtype must be 'bf16' or null, got 'float16'"):
        Update(param_dtype="float16")


SETTINGS = {  # the quickstart, and its neighbours that run other passes or other modules in the update
    "quickstart": (),
    "PPO's critic": ("--config", "configs/objectives/ppo.yaml"),
    "LoRA, reference with adapters off": ("--model.policy.lora.r", "4"),
    "gradient checkpointing": ("--model.policy.gradient_checkpointing", "true"),
    "MoE with routing replay": ("--model.policy.name", "tiny-qwen3-moe", "--model.policy.routing.replay", "true"),
    "rollouts one version behind": ("--model.generation.max_staleness", "1"),
    "PPO's critic without autocast": ("--config", "configs/objectives/ppo.yaml", "--trainer.precision", "32-true"),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_bf16_mixed_fit_trains_on_bf16_casts_and_samples_validates_and_saves_as_before(tmp_path, setting):
    """From the command line, as a user sets it: every pass of the policy reads bf16 casts, the update's (grad and
    no-grad) and the sampler's (rollouts and validation: the sampler computes what the update computes); the losses
    are finite and the policy leaves the fit with its fp32 parameters, moved."""
    from test_trainer import ROOT, tiny_args

    from lit_gspo.runtime.sharding import forward_root
    from lit_gspo.tools.main import cli_main

    extra = ("--model.update.num_minibatches", "2", "--trainer.precision", "bf16-mixed", *SETTINGS[setting])
    extra = tuple(str(ROOT / a) if a.startswith("configs/") else a for a in extra)
    root = ("--trainer.default_root_dir", str(tmp_path))  # after PPO's overlay, which names its own
    cli = cli_main([*tiny_args(tmp_path, *extra), *root, "--model.update.param_dtype", "bf16"], run=False)
    policy = cli.model.policy
    seen = []  # (grad enabled, the embedding's dtype) at each forward of the policy
    forward_root(policy).register_forward_pre_hook(  # (LoRA: the model inside peft's, which sampling calls)
        lambda module, args: seen.append((torch.is_grad_enabled(), module.get_input_embeddings().weight.dtype))
    )
    before = [p.detach().clone() for p in policy.parameters()]
    losses = []
    cli.model.learner.hooks.hooks.append(Losses(losses))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert set(seen) == {(True, torch.bfloat16), (False, torch.bfloat16)}  # training; sampling, old-policy passes
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))  # 3 RL steps × 2 optimiser steps
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in policy.parameters())
    moved = any(not torch.equal(b, p.cpu()) for b, p in zip(before, policy.parameters()))
    assert moved == any(norm > 0 for norm in cli.model.learner.hooks.hooks[-1].norms)  # (a rollout may hold no signal)
    assert moved or setting == "rollouts one version behind"


class Losses(UpdateHook):
    def __init__(self, losses):
        self.losses, self.norms = losses, []

    def may_step(self, update, minibatch, loss, grad_norm):
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return True


def test_under_fsdp2_the_gathered_parameters_are_the_casts_and_the_update_is_the_unsharded_ones():
    """FSDP2 gathers and frees the parameters around each layer's forward: there its own mixed precision casts them as
    it gathers them (``shard_model(..., param_dtype)``: bf16 parameters, gradients reduced in fp32), and the update on
    one process is the unsharded update on the casts."""
    from torch.distributed.tensor import DTensor

    plain, sharded = plain_and_sharded_updates(Update(**UPDATE, param_dtype="bf16"), torch.bfloat16)
    for (name, a), b in zip(plain.policy.named_parameters(), sharded.policy.parameters()):
        assert isinstance(b, DTensor) and b.dtype == torch.float32, name
        torch.testing.assert_close(b.full_tensor(), a, rtol=0, atol=1e-6, msg=name)
    assert any(
        not torch.equal(a, b) for a, b in zip(plain.policy.parameters(), make_learner(Update()).policy.parameters())
    )


def test_with_gradient_checkpointing_the_recomputed_layers_read_the_same_casts():
    """Checkpointed layers run forward again inside backward: there they read the step's casts (an fp32 recomputation
    would not give the saved activations' dtypes), so the update is the one without checkpointing, bit for bit."""
    plain = make_learner(Update(**UPDATE, param_dtype="bf16"))
    recomputed = make_learner(Update(**UPDATE, param_dtype="bf16"), gradient_checkpointing=True)
    rollout = sample_rollout(plain.policy)
    for learner in (plain, recomputed):
        torch.manual_seed(1)
        learner.learn(with_rewards(learner, rollout, REWARDS), torch.optim.SGD(learner.policy.parameters(), lr=0.5))
    for (name, a), b in zip(plain.policy.named_parameters(), recomputed.policy.parameters()):
        assert torch.equal(a, b), name
    assert any(
        not torch.equal(a, b) for a, b in zip(plain.policy.parameters(), make_learner(Update()).policy.parameters())
    )


ENGINES = {
    "LeanSampler": lambda: LeanSampler(),
    "HFGenerate": lambda: HFGenerate(),
    "StaticCacheSampler": lambda: StaticCacheSampler(compile=False),
    "StaticCacheSampler compiled": lambda: StaticCacheSampler(compile=True),
    "StaticCacheSampler without precast": lambda: StaticCacheSampler(compile=False, precast_weights=False),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_engine_samples_from_the_casts_as_from_a_model_with_bf16_parameters(model, engine):
    """With ``update.param_dtype`` the sampler computes what the update computes (the mismatch layer would otherwise
    see the fp32 residual stream of autocast against the update's bf16 one): twice in a row (the second after the
    weights moved, which a stale copy would miss), the tokens and log-probs of the same engine on a copy of the model
    whose parameters are bf16, under Lightning's autocast; the model's parameters come back as they were."""
    from test_static_cache_engine import PAD, PROMPTS

    policy, params = copy.deepcopy(model), list(model.parameters())
    cast_engine, plain_engine = ENGINES[engine](), ENGINES[engine]()
    kwargs = dict(num_generations=3, max_new_tokens=8, pad_id=PAD, eos_id=-1, return_logprobs=True)
    for step in range(2):
        bf16 = copy.deepcopy(policy)
        for p in bf16.parameters():
            p.data = p.data.to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            torch.manual_seed(step)
            got = cast_engine.sample(policy, PROMPTS, param_dtype=torch.bfloat16, **kwargs)
            torch.manual_seed(step)
            want = plain_engine.sample(bf16, PROMPTS, **kwargs)
        assert torch.equal(got.input_ids, want.input_ids), step
        torch.testing.assert_close(got.engine_logprobs, want.engine_logprobs, atol=0, rtol=0)
        with torch.no_grad():
            for p in policy.parameters():  # an optimiser step
                p.add_(torch.randn_like(p) * 0.5)
    assert [p.dtype for p in policy.parameters()] == [p.dtype for p in params] == [torch.float32] * len(params)


def test_vllm_is_built_in_the_update_s_param_dtype_where_its_dtype_is_auto():
    """VLLMEngine samples from its own weights: with ``update.param_dtype`` they are built (and pushed) in its dtype,
    also without autocast; otherwise autocast's, else the parameters' (read without importing vLLM)."""
    from lit_gspo.rl.engines.vllm import _trainer_dtype

    policy = torch.nn.Linear(2, 2)
    assert _trainer_dtype(policy, "cpu") == "float32"
    assert _trainer_dtype(policy, "cpu", torch.bfloat16) == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _trainer_dtype(policy, "cpu") == "bfloat16"


def test_casts_under_fp16_autocast_are_refused_naming_both_settings():
    """On a GPU ``16-mixed`` is fp16 autocast, which would cast the bf16 casts again (on the CPU Lightning runs bf16)."""
    from lit_gspo.lightning.checks import check_param_dtype

    with pytest.raises(ValueError, match=r"update.param_dtype='bf16' with trainer.precision='16-mixed'.*bf16-mixed"):
        check_param_dtype("bf16", "16-mixed")
    for precision in ("bf16-mixed", "32-true", "bf16-true"):
        check_param_dtype("bf16", precision)
    check_param_dtype(None, "16-mixed")
