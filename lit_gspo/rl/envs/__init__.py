"""Environments: what the policy talks to (``--model.environment SingleTurn``, or your class path)."""

from lit_gspo.rl.envs.base import Conversation, Environment, SingleTurn, Turn
from lit_gspo.rl.envs.calculator import calculator
from lit_gspo.rl.envs.retry import RetryWithFeedback
from lit_gspo.rl.envs.tool_calls import CALL_FORMATS, CallFormat, HermesFormat, PlainFormat, ToolCall
from lit_gspo.rl.envs.tools import ToolUse

__all__ = [
    "CALL_FORMATS",
    "CallFormat",
    "Conversation",
    "Environment",
    "HermesFormat",
    "PlainFormat",
    "RetryWithFeedback",
    "SingleTurn",
    "ToolCall",
    "ToolUse",
    "Turn",
    "calculator",
]
