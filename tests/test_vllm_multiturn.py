"""Multi-turn episodes sampled by VLLMEngine (issue 31): every turn continues from the exact token ids so far.

Greedy, vLLM's episodes are HFGenerate's token for token (both are given the same ids each turn); sampled, each
turn's engine log-probs are the trainer's fp32 forward over the assembled episode. Needs vLLM (``pytest -m vllm``).
"""

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: pip install 'lit-gspo[vllm]' (its own environment, see .ci/run)")

from lit_gspo.models.loading import load_policy  # noqa: E402
from lit_gspo.rl.collect import Collector  # noqa: E402
from lit_gspo.rl.config import Generation  # noqa: E402
from lit_gspo.rl.engines import HFGenerate, VLLMEngine  # noqa: E402
from lit_gspo.rl.envs import Environment, Turn  # noqa: E402
from lit_gspo.rl.rewards import CharAccuracy, RewardSet  # noqa: E402
from lit_gspo.rl.rollout import token_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm
ROWS = [{"prompt": "rev 12=", "answer": "21"}, {"prompt": "rev 345=", "answer": "543"}]


class Talker(Environment):
    """Answers every reply with " more=" until ``max_turns``."""

    def step(self, row, reply, state):
        return Turn(observation=" more=", done=False, reward=0.0)


@pytest.fixture(scope="module")
def tiny():
    # head size 32 (vLLM's CPU attention starts there): 2 heads of 32, one K/V head
    return load_policy("tiny-llama", seed=0, config_overrides={"num_attention_heads": 2, "num_key_value_heads": 1})


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngine(kv_cache_gb=0.05)
    yield engine
    engine.close()


def sample(policy, tok, engine, *, greedy: bool, G: int = 2):
    collector = Collector(
        Talker(max_turns=3),
        engine,
        RewardSet([CharAccuracy()]),
        tok,
        Generation(num_generations=G, max_new_tokens=5),
        engine_logprobs=not greedy,
    )
    torch.manual_seed(0)
    return collector.sample(policy, ROWS, greedy=greedy)[0]


def test_greedy_episodes_are_hf_generates_token_for_token(tiny, engine):
    policy, tok = tiny
    ours, hf = sample(policy, tok, engine, greedy=True), sample(policy, tok, HFGenerate(), greedy=True)
    assert ours.turn_ids is not None and int(ours.turn_ids.max()) == 2  # three replies per episode
    assert torch.equal(ours.input_ids, hf.input_ids) and torch.equal(ours.completion_mask, hf.completion_mask)
    assert torch.equal(ours.turn_ids, hf.turn_ids)


def test_sampled_episodes_carry_each_turns_engine_logprobs_equal_to_the_trainers(tiny, engine):
    policy, tok = tiny
    batch = sample(policy, tok, engine, greedy=False, G=3)
    mask = batch.completion_mask
    assert batch.engine_logprobs is not None and (batch.turn_ids[mask] == 2).any()  # tokens of the third reply
    with torch.no_grad():
        trainer = token_logprobs(policy, batch).logprobs
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=2e-5, rtol=0)
