"""Environments: what the policy talks to (``--model.environment SingleTurn``, or your class path)."""

from lit_gspo.envs.base import Conversation, Environment, SingleTurn, Turn

__all__ = ["Conversation", "Environment", "SingleTurn", "Turn"]
