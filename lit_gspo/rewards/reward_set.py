"""Combine reward functions into one weighted reward, masking samples a function failed on."""

from __future__ import annotations

import math
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_gspo.rewards.calling import CALL_INPUTS, TRAINER_COLUMNS, TRL_ONLY, Convention, convention


class RewardWarning(UserWarning):
    """A reward function failed; the samples it affects are masked (each kind logged once per function)."""


class RewardTimeout(TimeoutError):
    """A reward function with ``timeout_s`` did not return in time."""


def call_with_timeout(call: Callable[[], object], timeout_s: float | None, name: str = "reward"):
    """``call()``, given up after ``timeout_s`` seconds (None: no limit) with :class:`RewardTimeout`."""
    if timeout_s is None:
        return call()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except BaseException as err:  # noqa: BLE001 — handed to the caller
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True, name=f"lit_gspo-{name}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"no result within timeout_s={timeout_s:g} s (the call is abandoned)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@dataclass
class RewardScores:
    """The scores of N completions.

    Attributes:
        total: (N,) fp32, the weighted sum of all functions; 0 where ``valid`` is False.
        per_function: name → (N,) fp32 unweighted scores, NaN where that function failed.
        valid: (N,) bool, True where every function returned a finite number.
        num_failed: the number of invalid samples (``(~valid).sum()``).
    """

    total: Tensor
    per_function: dict[str, Tensor]
    valid: Tensor
    num_failed: int

    def means(self) -> dict[str, float]:
        """Mean of each function over the samples it scored (NaN if none), for logging."""
        out = {}
        for name, values in self.per_function.items():
            ok = torch.isfinite(values)
            out[name] = float(values[ok].mean()) if ok.any() else float("nan")
        return out


def function_name(fn: Callable) -> str:
    """The function's ``name`` attribute, else its ``__name__`` or class name in snake_case."""
    name = getattr(fn, "name", None)
    if not isinstance(name, str) or not name:
        name = getattr(fn, "__name__", None) or type(fn).__name__
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return re.sub(r"[^0-9a-z_]+", "_", name).strip("_") or "reward"


class RewardSet:
    """Weighted sum of reward functions that never lets one bad function or sample crash a run.

    A reward function returns one score (or None) per completion and takes one of two signatures,
    told apart once from its parameters (see ``lit_gspo.rewards.calling``):

    - lit_gspo's, called positionally: ``def f(prompts, completions, **columns)``;
    - TRL's (``GRPOTrainer``), called by keyword: ``def f(completions, **kwargs)``,
      ``def f(completions, answer, **kwargs)``, ``def f(prompts, completions, ground_truth, **kwargs)``,
      ``def f(completion_ids, **kwargs)`` — any function whose first parameter is ``completions`` or
      ``completion_ids``, that names both ``prompts`` and ``completions``, or that cannot take two
      positional arguments (``def f(**kwargs)``).

    Inputs: ``prompts`` and ``completions`` (lists of N strings), ``completion_ids`` (N lists of
    token ids, when the caller gives them), the dataset columns per sample (e.g. ``answer=[...]``)
    and trainer ones (``completion_lengths=[...]`` in tokens, ``max_completion_length=int``). A
    function without ``**kwargs`` gets only the inputs it names. ``check(columns)`` verifies at the
    start of a run that every required parameter can be filled.

    Failures are masked, counted and warned about (``RewardWarning``, once per function and kind):
    a function that raises marks the whole batch invalid; a returned ``None``, NaN, ±inf or non-number
    marks that sample invalid; a result of the wrong length marks the whole batch invalid.

    A function with a ``timeout_s`` attribute (e.g. a reward that calls a server or runs code) is called in a
    worker thread and given up after that many seconds: the batch counts as failed (``RewardTimeout``) instead of
    the run hanging, which under DDP would leave every other rank waiting in a collective. The abandoned call
    keeps its thread until it returns. Functions that time themselves out with ``signal.alarm`` (math_verify
    does) only work in the main thread: give them no ``timeout_s``.

    Args:
        functions: the reward functions.
        weights: one weight per function; None uses each function's ``weight`` attribute (default 1.0).
    """

    def __init__(self, functions: list[Callable], weights: list[float] | None = None) -> None:
        functions = list(functions)
        if not functions:
            raise ValueError("RewardSet needs at least one reward function, got an empty list")
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"reward function {fn!r} is not callable; expected (prompts, completions, **columns) "
                                "or TRL's (completions, **kwargs) -> list[float]")
        if weights is None:
            weights = [float(getattr(fn, "weight", 1.0)) for fn in functions]
        elif len(weights) != len(functions):
            raise ValueError(f"RewardSet got {len(weights)} weights for {len(functions)} functions; give one per function or None")
        for fn in functions:
            timeout_s = getattr(fn, "timeout_s", None)
            if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
                raise ValueError(f"reward function {function_name(fn)!r} has timeout_s={timeout_s!r}; give seconds > 0, "
                                 "or None for no limit")
        self.functions = functions
        self.weights = [float(w) for w in weights]
        self.names = self._unique_names(functions)
        self.conventions = [convention(fn) for fn in functions]
        self._warned: set[tuple[str, str]] = set()
        self.last_error: str | None = None  # the latest failure, named in the trainer's error when no step can learn

    @staticmethod
    def _unique_names(functions: list[Callable]) -> list[str]:
        names, seen = [], {}
        for fn in functions:
            base = function_name(fn)
            seen[base] = seen.get(base, 0) + 1
            names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
        return names

    def _warn(self, name: str, kind: str, message: str) -> None:
        self.last_error = message
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            warnings.warn(message + " (the affected samples are masked; further warnings of this kind are silenced)",
                          RewardWarning, stacklevel=3)

    def check(self, columns: list[str]) -> None:
        """Fail now if a function has a required parameter no call will fill.

        Args:
            columns: the dataset's column names (``"prompt"`` is ignored: it arrives as ``prompts``);
                the trainer columns ``completion_lengths`` and ``max_completion_length`` are added.

        Raises:
            ValueError: naming each such function, its parameters, the unfillable ones and what is available.
        """
        columns = [c for c in dict.fromkeys(columns) if c != "prompt"]
        available = columns + [c for c in TRAINER_COLUMNS if c not in columns]
        problems = []
        for name, conv in zip(self.names, self.conventions):
            missing = conv.missing(set(CALL_INPUTS) | set(available))
            if missing:
                style = "TRL keyword style" if conv.keyword else "positional style (prompts, completions, **columns)"
                problems.append(f"reward function {name!r} {conv.describe()} [{style}] cannot be given {missing}")
                if set(missing) & set(TRL_ONLY):
                    problems[-1] += f" ({sorted(set(missing) & set(TRL_ONLY))} exist only in TRL)"
        if problems:
            raise ValueError("; ".join(problems) + f". Available inputs: {list(CALL_INPUTS)} and the columns {available}. "
                             "Rename the parameter to a column, give it a default, or add the column to the data "
                             "(the answer column is always passed as 'answer').")

    def _run(self, name: str, fn: Callable, conv: Convention, prompts: list[str], completions: list[str], columns: dict,
             completion_ids: list | None) -> Tensor:
        """Call one function; returns (N,) fp32 with NaN wherever it failed."""
        n = len(completions)
        nan = torch.full((n,), float("nan"))
        try:
            result = call_with_timeout(lambda: conv.call(fn, prompts, completions, columns, completion_ids),
                                       getattr(fn, "timeout_s", None), name)
        except Exception as err:  # noqa: BLE001 — a reward bug must not kill the run
            self._warn(name, "raised", f"reward function {name!r} raised {type(err).__name__}: {err}")
            return nan
        if isinstance(result, Tensor):
            result = result.tolist()
        try:
            result = list(result)
        except TypeError:
            self._warn(name, "type", f"reward function {name!r} returned {type(result).__name__}, expected a list of {n} floats")
            return nan
        if len(result) != n:
            self._warn(name, "length", f"reward function {name!r} returned {len(result)} scores for {n} completions")
            return nan
        values = []
        for v in result:
            try:
                values.append(float("nan") if v is None else float(v))
            except (TypeError, ValueError):
                values.append(float("nan"))
        bad = sum(not math.isfinite(v) for v in values)
        if bad:
            self._warn(name, "invalid", f"reward function {name!r} returned None/NaN/inf or a non-number for {bad} of {n} samples")
        out = torch.tensor(values, dtype=torch.float32)
        return out.masked_fill(~torch.isfinite(out), float("nan"))

    def score(self, prompts: list[str], completions: list[str], columns: dict | None = None,
              completion_ids: list[list[int]] | None = None) -> RewardScores:
        """Score N completions: ``columns`` maps column name → list of N values (or a scalar);
        ``completion_ids`` holds each completion's token ids (no padding), for functions that take them."""
        if len(prompts) != len(completions):
            raise ValueError(f"RewardSet.score got {len(prompts)} prompts for {len(completions)} completions")
        columns = dict(columns or {})
        n = len(completions)
        per_function = {name: self._run(name, fn, conv, prompts, completions, columns, completion_ids)
                        for name, fn, conv in zip(self.names, self.functions, self.conventions)}
        valid = torch.ones(n, dtype=torch.bool)
        total = torch.zeros(n, dtype=torch.float32)
        for weight, values in zip(self.weights, per_function.values()):
            valid &= torch.isfinite(values)
            total += weight * torch.nan_to_num(values, nan=0.0)
        total = total.masked_fill(~valid, 0.0)
        return RewardScores(total=total, per_function=per_function, valid=valid, num_failed=int((~valid).sum()))
