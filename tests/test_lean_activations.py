"""Lean RMSNorms and SwiGLUs (``models/lean_activations.py``): the plain modules' gradients bit for bit, fewer bytes
kept for backward by exactly what the formulas drop, and other forms left alone."""

import contextlib
import copy

import pytest
import torch
from test_learner import G, learn, make_learner, sample_rollout, with_rewards
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lit_gspo.models import checkpointing_active, enable_gradient_checkpointing, load_policy
from lit_gspo.models.cast_parameters import CastParameters
from lit_gspo.models.lean_activations import LeanActivations, gated_mlp_qualifies, rmsnorm_qualifies
from lit_gspo.rl.config import Update
from lit_gspo.runtime.token_budget import saved_bytes_per_token

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)


def llama(layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SHAPE))


def qwen3(layers: int = 3) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, head_dim=16, **SHAPE))


def precision(model: nn.Module, name: str):
    if name == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if name == "bf16 casts":
        return CastParameters(torch.bfloat16).active(model)
    return contextlib.nullcontext()


def forward_backward(model: nn.Module, setting: str, lean: bool):
    """Logits and every parameter's gradient of one forward/backward over padded rows."""
    model.zero_grad(set_to_none=True)
    ids = torch.arange(3 * 17).reshape(3, 17) * 37 % 300
    attention = torch.ones_like(ids)
    attention[1:, :4] = 0
    with LeanActivations().active(model) if lean else contextlib.nullcontext(0) as count, precision(model, setting):
        logits = model(input_ids=ids, attention_mask=attention).logits
        loss = (logits.float().log_softmax(-1)[..., 5] * attention).sum()
    loss.backward()
    return count, logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("setting", ["fp32", "autocast", "bf16 casts"])
@pytest.mark.parametrize("build, lean_per_layer", [(llama, 3), (qwen3, 5)], ids=["llama", "qwen3"])
def test_the_gradients_are_the_plain_modules_bit_for_bit(build, lean_per_layer, setting):
    """Two norms and the MLP a layer (Qwen3: its q and k norms too), the final norm and every Linear (sharing autocast's
    copies) run lean, and every logit and every parameter's gradient equals the plain modules' exactly: autograd's
    formulas in autograd's order."""
    model = build()
    _, plain_logits, plain = forward_backward(model, setting, lean=False)
    count, logits, lean = forward_backward(model, setting, lean=True)
    assert count == {"rmsnorm": 3 * (lean_per_layer - 1) + 1, "swiglu": 3, "linear": 3 * 7 + 1}  # (+ the LM head)
    assert torch.equal(logits, plain_logits)
    different = [name for name in plain if not torch.equal(plain[name], lean[name])]
    assert not different
    assert all("forward" not in vars(module) for module in model.modules())  # gone on leaving


@pytest.mark.parametrize("setting", ["fp32", "autocast"])
@pytest.mark.parametrize("build", [llama, qwen3], ids=["llama", "qwen3"])
def test_a_token_keeps_what_the_formulas_drop_fewer_bytes(build, setting):
    """Per token and layer, fp32: x̂ of each norm (hidden values; Qwen3's q and k norms: (heads + kv heads) · head_dim
    more) and silu(gate) (intermediate values), 4 bytes each; the final norm's x̂ once. Under bf16 autocast: the
    norms' fp32 x̂ (Qwen3's q/k norms: their fp32 copy of a bf16 input and their bf16 x̂, 4 bytes), silu(gate) in bf16,
    and two of the three bf16 copies of the first norm's output (q, k, v) and one of the two of the second's (gate,
    up)."""
    model = build(layers=2)
    config = model.config
    hidden, intermediate = config.hidden_size, config.intermediate_size
    heads = (config.num_attention_heads + config.num_key_value_heads) * getattr(config, "head_dim", 0)

    def forward(length):
        return model(input_ids=torch.arange(length)[None] % 300).logits

    with precision(model, setting):
        plain = saved_bytes_per_token(forward)
        with LeanActivations().active(model):
            lean = saved_bytes_per_token(forward)
    if setting == "fp32":
        per_layer = 4 * (2 * hidden + intermediate)
    else:
        per_layer = 4 * 2 * hidden + 2 * intermediate + 2 * 3 * hidden
    if isinstance(model, Qwen3ForCausalLM):
        per_layer += 4 * heads
    assert plain - lean == 2 * per_layer + 4 * hidden


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)).to(x)


class ScaledRMSNorm(GemmaStyleRMSNorm):
    def forward(self, x):  # reads an attribute the lean form does not have
        return self.scale * x


def test_other_forms_keep_their_own_forward():
    """A norm of another form, a forward reading more than the lean one knows, an MLP with another activation: no
    lean forward."""
    assert rmsnorm_qualifies(type(llama(1).model.norm), 1e-6)
    assert not rmsnorm_qualifies(GemmaStyleRMSNorm, 1e-6)
    assert not rmsnorm_qualifies(ScaledRMSNorm, 1e-6)
    mlp = llama(1).model.layers[0].mlp
    assert gated_mlp_qualifies(type(mlp), mlp.act_fn, bias=False)
    assert not gated_mlp_qualifies(type(mlp), nn.GELU(), bias=False)
    model = llama(1)
    model.model.norm = GemmaStyleRMSNorm(64)
    model.model.layers[0].mlp.act_fn = nn.GELU()
    with LeanActivations().active(model) as count:
        assert count == {"rmsnorm": 2, "linear": 8}  # the layer's two norms; its Linears and the head
        assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)


def test_the_probe_draws_nothing_from_the_runs_random_stream():
    model = llama(1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with LeanActivations().active(model):
        pass
    assert torch.equal(torch.get_rng_state(), before)


def test_without_grad_each_module_runs_its_own_forward():
    """Inside the context a no-grad pass (old log-probs, a sampler) is the class's forward: nothing saved, the same
    logits."""
    model = llama()
    ids = torch.arange(20)[None] % 300
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with LeanActivations().active(model):
            lean = model(input_ids=ids).logits
    assert torch.equal(plain, lean)


def test_an_update_is_the_same_with_and_without_lean_activations():
    """A whole ``learn`` (two minibatches, micro-batches, a shared prompt forward): the same parameters after it."""
    results = []
    for lean in (True, False):
        learner = make_learner(Update(num_minibatches=2, micro_batch_size=4, lean_activations=lean))
        rollout = with_rewards(learner, sample_rollout(learner.policy), [0.0, 1.0, 3.0] * (12 // G))
        learn(learner, rollout)
        results.append(copy.deepcopy(learner.policy.state_dict()))
        assert (learner.lean_activations is not None) == lean
    assert all(torch.equal(results[0][name], results[1][name]) for name in results[0])


def test_compiled_layers_choose_what_to_keep_themselves():
    """Under ``update.compile`` the compiler decides what a layer keeps: no lean forward; where compiling cannot run
    (gradient checkpointing: the update runs eagerly), the lean modules do."""
    with make_learner(Update(compile=True)).lean() as count:
        assert count is None
    layers = make_learner(Update()).policy.config.num_hidden_layers
    with make_learner(Update(compile=True), gradient_checkpointing=True).lean() as count:
        assert count["rmsnorm"] + count["swiglu"] == 3 * layers + 1


@pytest.mark.parametrize("setting", ["fp32", "autocast"])
@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_lora_adapters_train_the_same_through_lean_modules(targets, setting):
    """LoRA (peft) on the attention's projections, or on every linear layer (the MLP's gate and up projections then
    adapters too; under autocast the base layer and the adapter's A share one copy of their input): the lean modules
    run, the adapters' gradients are the plain modules' bit for bit."""
    from lit_gspo.models.lora import apply_lora

    policy, _ = load_policy("tiny-llama", seed=0)
    policy = apply_lora(policy, r=4, alpha=8, **({"target_modules": "all-linear"} if targets == "all-linear" else {}))
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # (zero at init: no gradient would reach lora_A)
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.arange(40).reshape(2, 20) % 20
    grads = []
    for lean in (False, True):
        policy.zero_grad(set_to_none=True)
        with LeanActivations().active(policy) if lean else contextlib.nullcontext(0) as count:
            with precision(policy, setting):
                logits = policy(input_ids=ids).logits
            logits.float().log_softmax(-1)[..., 3].sum().backward()
        grads.append({name: p.grad for name, p in policy.named_parameters() if p.grad is not None})
    assert count["rmsnorm"] + count["swiglu"] == 3 * policy.config.num_hidden_layers + 1
    assert grads[0].keys() == grads[1].keys() and all(name.count("lora_") for name in grads[0])
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


class NormWithResidual(nn.Module):
    """An RMSNorm of the plain form that also takes a residual to add first (as fused-add norms do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), eps

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states = hidden_states + residual
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_a_call_with_more_arguments_than_the_probe_saw_runs_the_class_forward():
    norm, x, residual = NormWithResidual(8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        expected = norm(x, residual=residual)
    with LeanActivations().active(norm) as count:
        assert count == {"rmsnorm": 1}  # qualifies: its one-argument form is the plain one
        assert torch.equal(norm(x, residual=residual), expected)
        assert torch.equal(norm(x, residual), expected)


@pytest.mark.parametrize("setting", ["fp32", "autocast"])
def test_under_gradient_checkpointing_the_recomputed_layers_run_lean_and_give_the_same_gradients(setting):
    """Checkpointing recomputes each layer in backward, its lean modules and shared casts again: the saved tensors
    match the forward's, and the gradients the plain modules' bit for bit."""
    policy, _ = load_policy("tiny-llama", seed=0)
    enable_gradient_checkpointing(policy)
    ids = torch.arange(40).reshape(2, 20) % 20
    grads = []
    for lean in (False, True):
        policy.zero_grad(set_to_none=True)
        with checkpointing_active(policy), LeanActivations().active(policy) if lean else contextlib.nullcontext(0):
            with precision(policy, setting):
                logits = policy(input_ids=ids).logits
            logits.float().log_softmax(-1)[..., 3].sum().backward()
        grads.append({name: p.grad for name, p in policy.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
