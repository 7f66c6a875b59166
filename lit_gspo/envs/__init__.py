"""Environments: what the policy talks to (``--model.environment SingleTurn``, or your class path)."""

from lit_gspo.envs.base import Conversation, Environment, SingleTurn, Turn
from lit_gspo.envs.retry import RetryWithFeedback

__all__ = ["Conversation", "Environment", "RetryWithFeedback", "SingleTurn", "Turn"]
