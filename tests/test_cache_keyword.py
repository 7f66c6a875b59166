"""The KV cache is passed by the keyword the model's forward declares: ``cache`` from transformers 5.24 (its
``past_key_values`` deprecated, warning at every call that passes it, and removed in 5.40), ``past_key_values`` before."""

import inspect
import warnings

import pytest
import torch
from conftest import EOS, PAD
from torch import nn

from lit_gspo.models.cache_keyword import cache_keyword, cache_kwargs
from lit_gspo.rl.config import Update
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.objectives import GSPO


class OldForward(nn.Module):  # a model written against transformers < 5.24 (or remote code)
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


class NewForward(nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return cache


def test_the_keyword_is_the_one_the_forward_declares(model):
    assert cache_keyword(OldForward()) == "past_key_values"
    assert cache_keyword(NewForward()) == "cache"
    declared = inspect.signature(type(model).forward).parameters
    assert cache_keyword(model) == ("cache" if "cache" in declared else "past_key_values")
    assert cache_kwargs(model, None) == {}  # none passed: no deprecated name either


def test_a_peft_wrapper_is_looked_through_to_its_model(model):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(
        type(model)(model.config), peft.LoraConfig(r=2, target_modules=["q_proj"], lora_alpha=4)
    )
    assert "cache" not in inspect.signature(type(wrapped).forward).parameters  # PEFT passes **kwargs through
    assert cache_keyword(wrapped) == cache_keyword(model)


@pytest.mark.parametrize("engine", [LeanSampler(), StaticCacheSampler(), HFGenerate()], ids=type)
def test_sampling_and_an_update_pass_the_cache_without_a_deprecation_warning(model, engine):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        batch = engine.sample(
            model, [[5, 6, 7], [8, 9, 10, 11]], num_generations=2, max_new_tokens=5, pad_id=PAD, eos_id=EOS
        )
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        # two minibatches: the second's old log-probs; rows sharing a prompt: the shared prompt forward (its cache)
        learner = Learner(model, GSPO(), Update(num_minibatches=2, share_prompt_forward=True), max_len=5, group_size=2)
        learner.learn(batch, torch.optim.SGD(model.parameters(), lr=0.0))


@pytest.mark.parametrize("module", [OldForward(), NewForward()], ids=type)
def test_a_compiled_function_reads_the_keyword_as_a_constant(module):
    """A compiled decoding step (StaticCacheSampler's) resolves the keyword while tracing, in one graph. torch 2.11's
    compiler takes only constants as the arguments of a function it assumes constant (a module is not one)."""

    @torch.compile(backend="eager", fullgraph=True)
    def passes_the_cache(x):
        return module(x, **cache_kwargs(module, x)) + 1

    x = torch.zeros(2)
    assert torch.equal(passes_the_cache(x), x + 1)
