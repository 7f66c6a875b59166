"""Which stage a setting lives on: the objective's paper fills in what the user leaves unset, and only that."""

import pytest

from lit_gspo.lightning.module import RLModule
from lit_gspo.rl.advantages import GAE, RLOO, GroupMean, GroupNormalized
from lit_gspo.rl.config import Generation, Policy
from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.envs import SingleTurn
from lit_gspo.rl.objectives import DAPO, GSPO, PPO, DrGRPO


def module(**kwargs) -> RLModule:
    return RLModule(policy=Policy("tiny-llama", kl_to_ref=False), **kwargs)


def test_unset_stages_take_the_objectives_paper_and_set_ones_win():
    assert type(module(objective=DrGRPO()).advantage) is GroupMean
    assert type(module(objective=PPO()).advantage) is GAE
    assert type(module(objective=GSPO()).advantage) is GroupNormalized
    assert type(module(objective=DrGRPO(), advantage=RLOO()).advantage) is RLOO
    assert module(objective=DAPO()).collector.dynamic_sampling is True
    assert module(objective=DAPO(), generation=Generation(dynamic_sampling=False)).collector.dynamic_sampling is False
    assert module(objective=GSPO()).collector.dynamic_sampling is False
    defaults = module()
    assert (type(defaults.collector.environment), type(defaults.collector.engine)) == (SingleTurn, HFGenerate)


def test_a_critic_and_its_estimator_come_together():
    with pytest.raises(ValueError, match="GroupNormalized does not use a critic's values, and PPO has critic"):
        module(objective=PPO(), advantage=GroupNormalized())
    with pytest.raises(ValueError, match="GAE needs a critic's values, and GSPO has no critic"):
        module(objective=GSPO(), advantage=GAE())
    assert module(objective=PPO()).learner.value_head is not None
    assert module(objective=GSPO()).learner.value_head is None
