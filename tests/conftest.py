"""Shared fixtures: a tiny random Llama with fixed special-token ids, for rollout and sampler tests."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=23, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def no_global_seed_between_tests():
    """A fit's ``seed_everything`` sets PL_GLOBAL_SEED, which seeds later datamodules and modules: clear it around every test."""
    import os

    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)


def pytest_addoption(parser):
    parser.addoption("--faults", action="store_true", default=False,
                     help="run the fault-injection tests (marker `faults`): real signals and SIGKILLs of CLI runs in "
                          "subprocesses, a few minutes; `pytest -m faults --faults`")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--faults"):
        return
    skip = pytest.mark.skip(reason="fault injection (minutes): run with `pytest -m faults --faults`")
    for item in items:
        if "faults" in item.keywords:
            item.add_marker(skip)
