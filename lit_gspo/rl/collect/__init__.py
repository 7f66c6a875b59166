"""collect: Environment × RolloutEngine → trajectories and rewards (``collector.py``); multi-turn episodes
assembled into one token sequence per row (``episodes.py``)."""

from lit_gspo.rl.collect.collector import Collector
from lit_gspo.rl.collect.episodes import Episode, assemble, episode_stats, replies_of, step_all

__all__ = ["Collector", "Episode", "assemble", "episode_stats", "replies_of", "step_all"]
