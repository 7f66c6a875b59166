"""A multi-turn environment whose episodes take a different number of turns on each rank (rank r: r + 1 replies),
for the distributed engine tests (``--model.environment rank_turns.TurnsByRank`` with ``tests/`` on the path)."""

import torch.distributed as dist

from lit_gspo.rl.envs import Environment, Turn


class TurnsByRank(Environment):
    def step(self, row, reply, state):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return Turn(observation=" more=", done=state["turn"] >= rank + 1, reward=0.0)
