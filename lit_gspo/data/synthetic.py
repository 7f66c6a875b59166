"""Built-in prompt tasks that need no download: deterministic per seed, with exact answers.

Every task returns rows ``{"prompt": str, "answer": str}`` (``arithmetic`` also ``"expression"``:
``"12 + 7"``, e.g. for a tool-use demonstration). Whether a prompt belongs to the
held-out (validation) split is a fixed property of its text (a stable hash puts ``HOLDOUT_FRACTION``
of all prompts there), so training and validation prompts never overlap, whatever the seeds or
sizes of the two calls.

Tasks (``TASKS``), keyword arguments and the size of their prompt space:

- ``arithmetic``: ``"12+7="`` → ``"19"``. ``digits`` (operands in [0, 10^digits)), ``ops`` (a
  subset of ``"+-*"``), ``negative`` (False: subtraction operands are ordered so a ≥ b), ``template``
  (a format string with ``{a}``, ``{op}``, ``{b}``, e.g. ``"What is {a} {op} {b}? "``).
- ``reversal``: ``"rev 3812="`` → ``"2183"``. ``min_length``, ``max_length``, ``alphabet``, ``template``.
- ``counting``: ``"count a in abcab="`` → ``"2"``. ``length``, ``alphabet``, ``template``.
- ``sorting``: ``"sort 3812="`` → ``"1238"``. ``min_length``, ``max_length``, ``alphabet``, ``template``.
- ``hidden_rule``: ``"? 382="`` → ``"283"``, ``"382"`` or ``"823"``: a rule drawn per row (``rules``, among
  ``keep``, ``reverse``, ``rotate``) that the prompt does not show, so a first reply can only guess it; a
  multi-turn environment's feedback (``RetryWithFeedback``'s hint) is what tells the rules apart.
  ``length``, ``alphabet``, ``rules``, ``template``.

Quickstart suggestion: ``reversal`` or ``sorting`` with ``min_length=max_length=3`` and digits,
scored with ``CharAccuracy``: answers are 3 characters, a random policy over 10 digits already
earns ~1/10 per position, and credit is partial.
"""

from __future__ import annotations

import hashlib
import inspect
import random
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from lit_gspo.runtime.user_errors import option

HOLDOUT_FRACTION = 0.2
SPLITS = {"train": "train", "validation": "validation", "val": "validation", "test": "validation"}

#: the setting a task's options come from, as its errors name it: ``data.task_kwargs``, or ``data.val_task_kwargs``
#: while the data module makes the validation rows with options of their own (:func:`options_from`)
OPTIONS_SETTING: ContextVar[str] = ContextVar("OPTIONS_SETTING", default="data.task_kwargs")


@contextmanager
def options_from(setting: str) -> Iterator[None]:
    """A task's errors in this context name ``setting`` as where its options were given."""
    token = OPTIONS_SETTING.set(setting)
    try:
        yield
    finally:
        OPTIONS_SETTING.reset(token)


def _check_alphabet(alphabet: str) -> None:
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(
            f"{option(OPTIONS_SETTING.get(), {'alphabet': alphabet})}: the alphabet must be non-empty "
            "with distinct characters"
        )


def _check_lengths(min_length: int, max_length: int) -> None:
    if not 1 <= min_length <= max_length:
        raise ValueError(
            f"{option(OPTIONS_SETTING.get(), {'min_length': min_length, 'max_length': max_length})}: "
            "need 1 <= min_length <= max_length"
        )


def arithmetic(
    rng: random.Random, digits: int = 2, ops: str = "+-", negative: bool = False, template: str = "{a}{op}{b}="
) -> dict:
    """One ``a op b`` problem with operands of up to ``digits`` digits; the answer is the exact result."""
    if digits < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(
            f"{option(OPTIONS_SETTING.get(), {'digits': digits, 'ops': ops})}: arithmetic needs digits >= 1 "
            "and ops drawn from '+-*'"
        )
    a, b, op = rng.randrange(10**digits), rng.randrange(10**digits), rng.choice(ops)
    if op == "-" and not negative and a < b:
        a, b = b, a
    result = a + b if op == "+" else a - b if op == "-" else a * b
    return {"prompt": template.format(a=a, op=op, b=b), "answer": str(result), "expression": f"{a} {op} {b}"}


def _arithmetic_size(digits: int = 2, ops: str = "+-", negative: bool = False, **_) -> int:
    n = 10**digits
    return sum(n * (n + 1) // 2 if op == "-" and not negative else n * n for op in set(ops))


def _random_string(rng: random.Random, min_length: int, max_length: int, alphabet: str) -> str:
    _check_lengths(min_length, max_length)
    _check_alphabet(alphabet)
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))


def reversal(
    rng: random.Random,
    min_length: int = 3,
    max_length: int = 5,
    alphabet: str = string.digits,
    template: str = "rev {s}=",
) -> dict:
    """Reverse a random string: ``"rev 3812="`` → ``"2183"``."""
    s = _random_string(rng, min_length, max_length, alphabet)
    return {"prompt": template.format(s=s), "answer": s[::-1]}


def sorting(
    rng: random.Random,
    min_length: int = 3,
    max_length: int = 5,
    alphabet: str = string.digits,
    template: str = "sort {s}=",
) -> dict:
    """Sort the characters of a random string: ``"sort 3812="`` → ``"1238"``."""
    s = _random_string(rng, min_length, max_length, alphabet)
    return {"prompt": template.format(s=s), "answer": "".join(sorted(s))}


#: the transformations ``hidden_rule`` draws from
HIDDEN_RULES: dict[str, Callable[[str], str]] = {
    "keep": lambda s: s,
    "reverse": lambda s: s[::-1],
    "rotate": lambda s: s[1:] + s[:1],  # the first character moved to the end
}


def hidden_rule(
    rng: random.Random,
    length: int = 3,
    alphabet: str = string.digits,
    rules: str = "keep,reverse,rotate",
    template: str = "? {s}=",
) -> dict:
    """Apply a rule the prompt does not name: ``"? 382="`` → ``"382"`` (keep), ``"283"`` (reverse) or ``"823"`` (rotate).

    The row's ``rule`` column says which (``string``: the string as shown); only feedback on a wrong
    reply can reveal it to the policy.
    """
    names = rules.split(",")
    unknown = [r for r in names if r not in HIDDEN_RULES]
    if unknown or len(names) < 2:
        raise ValueError(
            f"hidden_rule rules must be two or more of {', '.join(HIDDEN_RULES)} (comma-separated), got {rules!r}"
        )
    s = _random_string(rng, length, length, alphabet)
    rule = rng.choice(names)
    return {"prompt": template.format(s=s), "answer": HIDDEN_RULES[rule](s), "rule": rule, "string": s}


def _hidden_rule_size(length: int = 3, alphabet: str = string.digits, **_) -> int:
    return len(alphabet) ** length


def _strings_size(min_length: int = 3, max_length: int = 5, alphabet: str = string.digits, **_) -> int:
    return sum(len(alphabet) ** k for k in range(min_length, max_length + 1))


def counting(rng: random.Random, length: int = 6, alphabet: str = "abc", template: str = "count {c} in {s}=") -> dict:
    """Count one character in a random string: ``"count a in abcab="`` → ``"2"``."""
    _check_lengths(length, length)
    _check_alphabet(alphabet)
    s = "".join(rng.choice(alphabet) for _ in range(length))
    c = rng.choice(alphabet)
    return {"prompt": template.format(c=c, s=s), "answer": str(s.count(c))}


def _counting_size(length: int = 6, alphabet: str = "abc", **_) -> int:
    return len(alphabet) ** (length + 1)


@dataclass(frozen=True)
class SyntheticTask:
    """A task: ``sample(rng, **kwargs)`` draws one row; ``size(**kwargs)`` counts its distinct prompts."""

    sample: Callable[..., dict]
    size: Callable[..., int]

    def options(self) -> list[str]:
        """The keyword arguments the task accepts."""
        return list(inspect.signature(self.sample).parameters)[1:]


TASKS: dict[str, SyntheticTask] = {
    "arithmetic": SyntheticTask(arithmetic, _arithmetic_size),
    "reversal": SyntheticTask(reversal, _strings_size),
    "counting": SyntheticTask(counting, _counting_size),
    "sorting": SyntheticTask(sorting, _strings_size),
    "hidden_rule": SyntheticTask(hidden_rule, _hidden_rule_size),
}


def get_task(name: str) -> SyntheticTask:
    """Look a task up in ``TASKS``; an unknown name raises listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; built-in tasks are {sorted(TASKS)}")
    return TASKS[name]


def is_held_out(prompt: str) -> bool:
    """True when ``prompt`` belongs to the validation split (a stable hash, the same on every run)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < HOLDOUT_FRACTION


def _options(kwargs: dict) -> str:
    return f" ({option(OPTIONS_SETTING.get(), kwargs)})" if kwargs else ""


def _count_setting(split: str) -> str:
    """The data module's setting that asks for ``n`` rows of ``split``."""
    return "data.num_val" if SPLITS.get(split) == "validation" else "data.num_train"


#: the loader's own arguments, which the data module sets from these settings
LOADER_SETTINGS = {
    "n": "--data.num_train and --data.num_val",
    "seed": "--data.seed",
    "split": "--data.train_split and --data.val_split",
    "source": "--data.train_source",
    "prompt_column": "--data.prompt_column",
    "answer_column": "--data.answer_column",
}


def check_task_options(name: str, kwargs: dict, hint: str = "") -> None:
    """A ValueError naming the options in ``kwargs`` (``OPTIONS_SETTING``: ``--data.task_kwargs``, or
    ``--data.val_task_kwargs``) that task ``name`` does not take, what
    it takes, and the setting for those that are the loader's own (``seed``: ``--data.seed``); ``hint`` ends it."""
    task = get_task(name)
    unknown = sorted(set(kwargs) - set(task.options()))
    if not unknown:
        return
    settings = [f"{key}: {LOADER_SETTINGS[key]}" for key in unknown if key in LOADER_SETTINGS]
    raise ValueError(
        f"synthetic task {name!r} got unknown options {unknown} ({option(OPTIONS_SETTING.get(), kwargs)}); "
        f"it accepts {task.options()}" + (f" (set by other settings: {'; '.join(settings)})" if settings else "") + hint
    )


def make_split(name: str, split: str, n: int, seed: int = 0, **kwargs) -> list[dict]:
    """Draw ``n`` distinct prompts of task ``name`` from ``split`` (``"train"`` or ``"validation"``/``"val"``/``"test"``).

    Deterministic given (name, split, n, seed, kwargs); the first rows do not depend on ``n``.
    Raises ``ValueError`` when the split holds fewer than ``n`` distinct prompts.
    """
    task = get_task(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for synthetic task {name!r}; use one of {sorted(SPLITS)}")
    check_task_options(name, kwargs)
    if n < 0:
        raise ValueError(f"{option(_count_setting(split), n)}: must be >= 0")
    held_out = SPLITS[split] == "validation"
    space = task.size(**kwargs)
    if space == 0:  # options no prompt satisfies (an empty alphabet, min_length > max_length): a draw names them
        task.sample(random.Random(0), **kwargs)
    share = HOLDOUT_FRACTION if held_out else 1 - HOLDOUT_FRACTION
    if n > space:
        raise ValueError(
            f"task {name!r}{_options(kwargs)} has only {space} distinct prompts (~{int(space * share)} in its "
            f"{SPLITS[split]} split); cannot draw {option(_count_setting(split), n)}. Ask for fewer or widen "
            f"the task ({option(OPTIONS_SETTING.get())}, e.g. more digits/length)."
        )
    rng = random.Random(f"{name}:{SPLITS[split]}:{seed}")
    rows, seen = [], set()
    attempts, max_attempts = 0, 50 * n + 20 * min(space, 200_000)
    while len(rows) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"task {name!r}{_options(kwargs)}: found only {len(rows)} distinct {SPLITS[split]} prompts for "
                f"the {option(_count_setting(split), n)} asked for (the task has {space} prompts, ~{int(space * share)} in "
                f"this split). Ask for fewer or widen the task ({option(OPTIONS_SETTING.get())})."
            )
        row = task.sample(rng, **kwargs)
        if row["prompt"] not in seen and is_held_out(row["prompt"]) == held_out:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def make_task(name: str, n: int, seed: int = 0, **kwargs) -> list[dict]:
    """``n`` distinct training rows of task ``name`` (``make_split(name, "train", n, seed, **kwargs)``)."""
    return make_split(name, "train", n, seed, **kwargs)


def task_splits(name: str, n_train: int, n_val: int, seed: int = 0, **kwargs) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, validation) rows of task ``name``; raises naming the sizes if the task is too small."""
    return make_split(name, "train", n_train, seed, **kwargs), make_split(name, "validation", n_val, seed, **kwargs)


def sft_examples(rows: list[dict]) -> list[tuple[str, str]]:
    """(prompt, answer) pairs for a supervised warm start on the task format."""
    return [(row["prompt"], row["answer"]) for row in rows]
