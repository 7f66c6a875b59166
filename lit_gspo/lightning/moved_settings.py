"""Settings that moved into a group keep their old names: ``--model.val_every_n_steps 5`` on the command line, and
``model: {val_every_n_steps: 5}`` in a config file or in a run saved before the move, are read as
``model.validation.every_n_steps``, with one line saying so (``lit_gspo.rl.config.MOVED_SETTINGS`` lists them)."""

from __future__ import annotations

import os
import re

import yaml

from lit_gspo.rl.config import MOVED_SETTINGS

_FLAG = re.compile(r"^--model\.(" + "|".join(MOVED_SETTINGS) + r")(?==|$)")
_CONFIG_FLAGS = ("--config", "-c")


def upgrade_tree(tree: dict) -> list[str]:
    """Move the old keys of ``tree`` (a parsed config: ``{"model": {...}}``, or one level down under a subcommand) to
    their groups, in place; returns the old keys it moved. A key given both ways keeps the new one."""
    moved = []
    for scope in [tree] + [v for k, v in tree.items() if k in ("fit", "validate", "test") and isinstance(v, dict)]:
        model = scope.get("model")
        if not isinstance(model, dict):
            continue
        for old, new in MOVED_SETTINGS.items():
            if old not in model:
                continue
            value = model.pop(old)
            group, key = new.split(".")
            if not isinstance(model.get(group), dict):
                model[group] = {}
            model[group].setdefault(key, value)
            moved.append(old)
    return moved


def _upgrade_config(value: str) -> tuple[str, list[str]]:
    """A ``--config`` value (a file or YAML text) with the moved keys in their groups, as YAML text; unchanged when
    it has none (a file stays a path)."""
    is_file = os.path.isfile(value)
    try:
        tree = yaml.safe_load(open(value).read() if is_file else value)
    except (OSError, yaml.YAMLError):
        return value, []
    if not isinstance(tree, dict):
        return value, []
    moved = upgrade_tree(tree)
    return (yaml.safe_dump(tree, sort_keys=False) if moved else value), [f"{value if is_file else 'the config'}: {m}"
                                                                          for m in moved]


def upgrade_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` with every moved setting under its new name (flags renamed, config files and texts rewritten); and, for
    each, where it was found (``"--model.val_every_n_steps"``, ``"my.yaml: val_every_n_steps"``)."""
    out, notes, i = [], [], 0
    while i < len(args):
        arg = args[i]
        flag = _FLAG.match(arg)
        if flag:
            old = flag.group(1)
            out.append(f"--model.{MOVED_SETTINGS[old]}" + arg[flag.end():])
            notes.append(f"--model.{old}")
        elif arg in _CONFIG_FLAGS and i + 1 < len(args):
            text, found = _upgrade_config(args[i + 1])
            out += [arg, text]
            notes += found
            i += 1
        elif arg.startswith("--config="):
            text, found = _upgrade_config(arg[len("--config="):])
            out.append("--config=" + text)
            notes += found
        else:
            out.append(arg)
        i += 1
    return out, notes


def describe(notes: list[str]) -> str:
    """One line naming what was read under its new name."""
    renames = sorted({f"model.{old} → model.{MOVED_SETTINGS[old]}" for old in
                      (re.split(r"[.: ]", note.rstrip())[-1] for note in notes)})
    return ("settings given under their old names, read as their groups' (update the command or file): "
            + "; ".join(renames))
