"""A user's mistake is one readable error, a bug keeps its traceback.

``lit-gspo`` (``lit_gspo.tools.main.main``) reports a *user error* as ``error: <message>`` on stderr and exits with code 2,
without a traceback; anything else propagates with its traceback (it is ours to fix). ``--debug`` (anywhere on the
command line) or ``LIT_GSPO_DEBUG=1`` shows the traceback of a user error too, and the parser's usage dump.

What counts as a user error (:func:`is_user_error`):

* an instance of :class:`UserError` (the marker: library code that checks what a user gave raises a subclass, e.g.
  :class:`SettingsError`, which is also a ``ValueError`` so ``except ValueError`` callers keep working; the run lock,
  a corrupt or remote checkpoint, a missing optional package and a hub push that cannot work are subclasses too);
* during the start checks only (before the first training step, or before ``lit-gspo eval`` starts generating): a
  ``ValueError`` or ``FileNotFoundError`` raised by lit_gspo's own code. The start checks are where the settings,
  the data files and columns and the reward signatures are validated, and their messages name the value and what
  is valid (the README's contract). The same exception raised later, or raised inside torch, transformers or a
  user's own reward code, is not treated as a user error: its traceback is what helps.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

EXIT_CODE = 2
DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIT_GSPO_DEBUG"
_PACKAGE = Path(__file__).resolve().parents[1]  # lit_gspo/


class UserError(Exception):
    """Marker base class: an error in what the user gave (a setting, a path, a column, a class path, a run
    directory). Reported by ``lit-gspo`` as one line and exit code 2."""


class SettingsError(UserError, ValueError):
    """A setting whose value cannot work (names the setting, the value and what is valid)."""


class RunDirError(SettingsError):
    """A fit that would mix two runs in one directory (a resume with other settings than the run's)."""


_started = False  # whether the start checks are over (set by mark_started, cleared by mark_starting)


def mark_starting() -> None:
    """A command begins its start checks (each fit of ``ablate`` too)."""
    global _started
    _started = False


def mark_started() -> None:
    """The start checks passed: from here a ``ValueError`` is a failure of the run, reported with its traceback."""
    global _started
    _started = True


def debug_requested() -> bool:
    """``--debug`` / ``LIT_GSPO_DEBUG=1`` (or jsonargparse's own ``JSONARGPARSE_DEBUG``)."""
    return any(
        os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
        for name in (DEBUG_ENV, "JSONARGPARSE_DEBUG")
    )


def _raised_by_lit_gspo(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback (where it was raised) is in the lit_gspo package."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    try:
        return Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


def is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, UserError):
        return True
    return not _started and isinstance(exc, (ValueError, FileNotFoundError)) and _raised_by_lit_gspo(exc)


def strip_debug(argv: list[str]) -> list[str]:
    """``argv`` without ``--debug``; when it was there, ``LIT_GSPO_DEBUG=1`` (inherited by launched ranks)."""
    if DEBUG_FLAG in argv:
        os.environ[DEBUG_ENV] = "1"
    return [a for a in argv if a != DEBUG_FLAG]


def report(exc: BaseException) -> None:
    """Print a user error as ``error: <message>`` and exit with code 2."""
    message = str(exc) or type(exc).__name__
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)


def run_reporting(main, *args):
    """``main(*args)``, with a user error reported in one line (exit 2); a bug, or ``--debug``, keeps the traceback."""
    mark_starting()
    try:
        return main(*args)
    except Exception as exc:  # SystemExit / KeyboardInterrupt pass through
        if debug_requested() or not is_user_error(exc):
            raise
        report(exc)


def parser_error(message: str) -> None:
    """A command-line mistake (an unknown option, a bad value, a misspelled key): the message and its hints, not
    the ~95-line usage dump; ``--help`` lists the options. Exits with code 2."""
    hinted = (
        "\n  " in message
    )  # the CLI parser's hints: close options, valid fields, known objectives, the extra to install
    print(f"error: {message}" + ("" if hinted else " (--help lists every option)"), file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)


def option(setting: str, value=...) -> str:
    """How a setting is typed on ``lit-gspo``'s command line, with its value as a user writes it:
    ``option("data.answer_column", "ground_truth")`` → ``--data.answer_column ground_truth``; ``None`` → ``null``,
    booleans ``true``/``false``, lists and dicts in YAML's flow style (``[1.0, 2.0]``), a string that YAML would
    read as something else quoted. Without ``value``, the option alone (``--data.answer_column``). Library code that
    refuses a user's setting names it this way (the path of the setting in the CLI and in a YAML config), not as a
    Python keyword (``answer_column=None``)."""
    name = f"--{setting}"
    return name if value is ... else f"{name} {option_value(value)}"


def option_value(value) -> str:
    """A value as it is typed after an option (YAML): ``null``, ``true``, ``0.5``, ``ground_truth``, ``[1, 2]``."""
    import yaml

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        try:
            plain = yaml.safe_load(value) == value and value.strip() == value and " " not in value
        except yaml.YAMLError:
            plain = False
        return value if plain else "'" + value.replace("'", "''") + "'"
    if isinstance(value, (list, tuple, dict)):
        return yaml.safe_dump(_plain(value), default_flow_style=True, width=10**9, sort_keys=False).strip()
    return str(value)


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
