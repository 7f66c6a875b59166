"""Combine reward functions into one weighted reward, masking samples a function failed on."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lit_gspo.rl.rewards.calling import CALL_INPUTS, TRAINER_COLUMNS, TRL_ONLY, TrainerState, convention
from lit_gspo.rl.rewards.reward_model import RewardModel, is_sequence_classifier
from lit_gspo.runtime.threads import start_thread
from lit_gspo.runtime.user_errors import option, option_value


class RewardWarning(UserWarning):
    """A reward function failed; the samples it affects are masked (each kind logged once per function)."""


class RewardFunctionError(ValueError):
    """The first scoring call of a run failed as a whole (see :meth:`RewardSet.score`'s ``strict``): the run stops
    at once instead of masking every sample for many steps."""


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

    thread = start_thread(target, f"lit_gspo-{name}")  # on the caller's device: a rank's GPU under DDP
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"no result within timeout_s={timeout_s:g} s (the call is abandoned)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def run_coroutine(coroutine: Coroutine):
    """Run ``coroutine`` to completion on this process's reward event loop and return its result.

    As in TRL's ``GRPOTrainer``, the loop runs for the whole process in a daemon thread, so a client an async
    reward keeps between calls (an HTTP session) stays bound to one live loop, and the call works from code
    that itself runs in an event loop (a notebook). A forked child starts its own loop.
    """
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            start_thread(_loop.run_forever, "lit_gspo-async-rewards")
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


@dataclass
class RewardScores:
    """The scores of N completions.

    Attributes:
        total: (N,) fp32, the weighted sum of the functions that scored each sample; 0 where ``valid`` is False.
        per_function: name → (N,) fp32 unweighted scores, NaN where that function failed or returned None.
        valid: (N,) bool, True where no function failed and at least one returned a number.
        num_failed: the number of invalid samples (``(~valid).sum()``), unscored ones (every function None) included.
        metrics: ``log_metric(name, value)`` calls of this scoring, name → mean value.
        extra: ``log_extra(column, values)`` calls of this scoring, column → the values (in call order).
    """

    total: Tensor
    per_function: dict[str, Tensor]
    valid: Tensor
    num_failed: int
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

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
    told apart once from its parameters (see ``lit_gspo.rl.rewards.calling``):

    - lit_gspo's, called positionally: ``def f(prompts, completions, **columns)``;
    - TRL's (``GRPOTrainer``), called by keyword: ``def f(completions, **kwargs)``,
      ``def f(completions, answer, **kwargs)``, ``def f(prompts, completions, ground_truth, **kwargs)``,
      ``def f(completion_ids, **kwargs)`` — any function whose first parameter is ``completions`` or
      ``completion_ids``, that names both ``prompts`` and ``completions``, or that cannot take two
      positional arguments (``def f(**kwargs)``).

    Inputs (TRL's contract, its GRPOTrainer docs "Using a custom reward function"): ``prompts`` and
    ``completions`` (N strings, or with chat prompts N message lists each: see
    ``lit_gspo.rl.rewards.calling.conversation_completions``), ``completion_ids`` (N lists of token ids,
    when the caller gives them), every dataset column under its own name (e.g. ``answer=[...]``),
    ``trainer_state`` (a :class:`~lit_gspo.rl.rewards.calling.TrainerState`), ``log_extra(column, values)``
    and ``log_metric(name, value)`` (collected in :class:`RewardScores` ``extra`` and ``metrics``), and
    the trainer's columns (``completion_lengths=[...]`` in tokens, ``max_completion_length=int``, ...). A
    function without ``**kwargs`` gets only the inputs it names. ``check(columns)`` verifies at the
    start of a run that every required parameter can be filled.

    ``async def`` functions are awaited concurrently (``asyncio.gather``, as TRL does) on a background event
    loop, after the plain functions ran one by one in the calling thread.

    A sample's reward is the weighted sum over the functions that scored it: ``None`` from a function leaves
    it out of that sample's sum (TRL's multi-task rewards: each function gives None for the other tasks'
    rows); a sample every function gave None is unscored and masked, with a warning (as TRL warns).
    Failures are masked, counted and warned about (``RewardWarning``, once per function and kind):
    a function that raises, returns a result of the wrong length, not a list, or a coroutine (from a function
    not declared ``async def``) marks the whole batch invalid; NaN, ±inf or a non-number marks that sample
    invalid (unlike None, which is not a failure; TRL folds NaN into its sum like None).

    A function with a ``timeout_s`` attribute (e.g. a reward that calls a server or runs code) is called in a
    worker thread and given up after that many seconds: the batch counts as failed (``RewardTimeout``) instead of
    the run hanging, which under DDP would leave every other rank waiting in a collective. The abandoned call
    keeps its thread until it returns. Functions that time themselves out with ``signal.alarm`` (math_verify
    does) only work in the main thread: give them no ``timeout_s``.

    Args:
        functions: the reward functions; a sequence-classification model among them is scored through
            :class:`RewardModel`, as TRL scores one given in ``reward_funcs``.
        weights: one weight per function; None uses each function's ``weight`` attribute (default 1.0).
    """

    def __init__(self, functions: list[Callable], weights: list[float] | None = None) -> None:
        # a sequence-classification model scores as TRL scores one given in reward_funcs
        functions = [RewardModel(fn) if is_sequence_classifier(fn) else fn for fn in functions]
        if not functions:
            raise ValueError("RewardSet needs at least one reward function, got an empty list")
        for fn in functions:
            if not callable(fn):
                raise TypeError(
                    f"reward function {fn!r} is not callable; expected (prompts, completions, **columns) "
                    "or TRL's (completions, **kwargs) -> list[float]" + _text_hint(fn)
                )
        if weights is None:
            weights = [float(getattr(fn, "weight", 1.0)) for fn in functions]
        elif len(weights) != len(functions):
            names = ", ".join(function_name(fn) for fn in functions)
            raise ValueError(
                f"{option('model.reward_weights', list(weights))} gives {len(weights)} weight"
                f"{'s' * (len(weights) != 1)} for the {len(functions)} reward function"
                f"{'s' * (len(functions) != 1)} of {option('model.rewards')} ({names}): give one weight "
                f"per function, in their order, or {option('model.reward_weights', None)} (each "
                "function's own weight, 1 by default)"
            )
        for fn in functions:
            timeout_s = getattr(fn, "timeout_s", None)
            if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
                raise ValueError(
                    f"reward function {function_name(fn)!r} of {option('model.rewards')} has timeout_s "
                    f"{option_value(timeout_s)}: give seconds > 0 (init_args: {{timeout_s: 30}}), or null "
                    "for no limit"
                )
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
            warnings.warn(
                message + " (the affected samples are masked; further warnings of this kind are silenced)",
                RewardWarning,
                stacklevel=3,
            )

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
            raise ValueError(
                "; ".join(problems) + f". Available inputs: {list(CALL_INPUTS)} and the columns {available}. "
                "Rename the parameter to a column, give it a default, or add the column to the data "
                "(the answer column is always passed as 'answer')."
            )

    def _call_all(self, prompts: list, completions: list, inputs: dict, completion_ids: list | None) -> list:
        """Every function's raw result, or the exception it raised: the plain functions one by one, then the
        ``async def`` ones concurrently on the reward event loop."""
        results: list = [None] * len(self.functions)
        pending = []
        for i, (name, fn, conv) in enumerate(zip(self.names, self.functions, self.conventions)):
            if conv.asynchronous:
                pending.append(i)
                continue
            try:
                results[i] = call_with_timeout(
                    lambda: conv.call(fn, prompts, completions, inputs, completion_ids),
                    getattr(fn, "timeout_s", None),
                    name,
                )
            except Exception as err:  # noqa: BLE001 — a reward bug must not kill the run (strict: see score)
                results[i] = _Raised(err)
        if pending:

            async def one(i: int):
                fn, timeout_s = self.functions[i], getattr(self.functions[i], "timeout_s", None)
                call = self.conventions[i].call(fn, prompts, completions, inputs, completion_ids)
                try:
                    return await asyncio.wait_for(call, timeout_s)
                except asyncio.TimeoutError:
                    raise RewardTimeout(f"no result within timeout_s={timeout_s:g} s (the call is cancelled)") from None

            async def gather():
                return await asyncio.gather(*(one(i) for i in pending), return_exceptions=True)

            for i, result in zip(pending, run_coroutine(gather())):
                results[i] = _Raised(result) if isinstance(result, BaseException) else result
        return results

    @staticmethod
    def _read(result, n: int) -> tuple[Tensor, Tensor, str | None, str | None]:
        """A function's raw result as (N,) fp32 scores (NaN where no finite number), (N,) bool None-mask, and for a
        call that failed as a whole its kind and what happened (else None, None)."""
        nan, no_none = torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.bool)
        if isinstance(result, _Raised):
            return nan, no_none, "raised", f"raised {type(result.error).__name__}: {result.error}"
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited on purpose: no "coroutine was never awaited" warning
            return (
                nan,
                no_none,
                "coroutine",
                (
                    f"returned {type(result).__name__} {result!r}: declare the function "
                    "`async def` (it is then awaited) or return the list itself"
                ),
            )
        if isinstance(result, Tensor):
            result = result.tolist()
        if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
            return nan, no_none, "type", f"returned {_preview(result)}"
        result = list(result)
        if len(result) != n:
            return nan, no_none, "length", f"returned {len(result)} scores for {n} completions: {_preview(result)}"
        values = []
        for v in result:
            try:
                values.append(float("nan") if v is None else float(v))
            except (TypeError, ValueError):
                values.append(float("nan"))
        out = torch.tensor(values, dtype=torch.float32)
        return (
            out.masked_fill(~torch.isfinite(out), float("nan")),
            torch.tensor([v is None for v in result], dtype=torch.bool),
            None,
            None,
        )

    def score(
        self,
        prompts: list,
        completions: list,
        columns: dict | None = None,
        completion_ids: list[list[int]] | None = None,
        *,
        trainer_state: TrainerState | None = None,
        strict: bool = False,
    ) -> RewardScores:
        """Score N completions.

        Args:
            prompts, completions: N each: text, or chat message lists (see the class docstring).
            columns: column name → list of N values (or a scalar).
            completion_ids: each completion's token ids (no padding), for functions that take them.
            trainer_state: given to the functions as ``trainer_state`` (None: a default ``TrainerState()``).
            strict: this is the run's first scoring call: raise :class:`RewardFunctionError` instead of masking
                when a function failed on the whole call in a way that is never legitimate (it raised, returned
                a result of the wrong length, not a list, a coroutine from a plain call, or numbers for none of
                the samples: NaN, ±inf or non-numbers where it did not return None), or when no sample was scored
                (every function returned None for every sample). A function returning None for every sample is
                fine while another scores them (a multi-task reward on a batch without its task); failures on some
                samples only are masked as on any call.

        Raises:
            RewardFunctionError: (``strict`` only) naming each such function, what it returned or raised, and
                what was expected.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"RewardSet.score got {len(prompts)} prompts for {len(completions)} completions")
        n = len(completions)
        metrics, extra = defaultdict(list), defaultdict(list)
        inputs = dict(columns or {})
        inputs.update(
            trainer_state=trainer_state if trainer_state is not None else TrainerState(),
            log_extra=lambda column, values: extra[column].extend(values),
            log_metric=lambda name, value: metrics[name].append(float(value)),
        )
        results = self._call_all(prompts, completions, inputs, completion_ids)
        per_function, nones, problems = {}, [], []
        for name, result in zip(self.names, results):
            values, none, kind, what = self._read(result, n)
            per_function[name], nones = values, nones + [none]
            scored_some = bool(torch.isfinite(values).any())
            if kind is None and not scored_some and not none.all():  # None everywhere: legitimate (another task's rows)
                kind, what = "invalid", f"returned no number for any of the {n} samples: {_preview(result)}"
            if kind is not None:
                problems.append((name, kind, what, result))
            elif bad := int((~torch.isfinite(values) & ~none).sum()):
                self._warn(
                    name,
                    "invalid",
                    f"reward function {name!r} returned NaN/inf or a non-number for {bad} of {n} samples",
                )
        values = torch.stack(list(per_function.values()), 1)  # (N, K)
        none = torch.stack(nones, 1)
        failed = (~torch.isfinite(values) & ~none).any(1)
        unscored = none.all(1)
        if strict and (problems or (n and bool(unscored.all()))):
            raise _first_call_error(problems, n, unscored_everywhere=bool(n and unscored.all()))
        for name, kind, what, _ in problems:
            self._warn(name, kind, f"reward function {name!r} {what}")
        if unscored.any():
            self._warn(
                "*",
                "unscored",
                f"every reward function returned None for {int(unscored.sum())} of {n} samples "
                f"(e.g. sample {int(unscored.nonzero()[0])}): no function scores them",
            )
        valid = ~failed & ~unscored
        weights = torch.tensor(self.weights, dtype=torch.float32)
        total = (torch.nan_to_num(values, nan=0.0) * weights).sum(1).masked_fill(~valid, 0.0)
        return RewardScores(
            total=total,
            per_function=per_function,
            valid=valid,
            num_failed=int((~valid).sum()),
            metrics={k: sum(v) / len(v) for k, v in metrics.items() if v},
            extra=dict(extra),
        )


@dataclass
class _Raised:
    """What a reward function raised instead of returning (kept apart from a returned value)."""

    error: BaseException


def _preview(result, first: int = 3) -> str:
    """``list of 5: [1.0, None, 'x', ...]``: a result's type, length and first values, for error messages."""
    if isinstance(result, (list, tuple)):
        head = ", ".join(repr(v)[:40] for v in result[:first]) + (", ..." if len(result) > first else "")
        return f"{type(result).__name__} of {len(result)}: [{head}]"
    return f"{type(result).__name__} {repr(result)[:80]}"


def _first_call_error(problems: list, n: int, unscored_everywhere: bool) -> RewardFunctionError:
    what = [f"reward function {name!r} {text}" for name, _, text, _ in problems]
    if unscored_everywhere and not problems:
        what.append(
            f"every reward function returned None for every one of the {n} samples, so nothing was scored "
            "(None means 'this function does not apply to this sample'; some function must score each sample)"
        )
    error = RewardFunctionError(
        "the first scoring call of the run failed, so the run stops now instead of masking every sample for many "
        f"steps: {'; '.join(what)}. Expected from each function: a list of {n} floats, one per completion (None for "
        "a completion it does not score)."
    )
    error.__cause__ = next((r.error for _, kind, _, r in problems if kind == "raised"), None)
    return error


def _text_hint(fn) -> str:
    """What a reward given as text (TRL's ``reward_funcs`` takes a model's id) is written as here."""
    if not isinstance(fn, str):
        return ""
    if "/" in fn or Path(fn).is_dir():
        return (
            f"; a reward model by its hub id or directory (TRL's reward_funcs takes it as text) is RewardModel({fn!r})"
        )
    return "; a function by its import path is the function itself (from module import function)"
