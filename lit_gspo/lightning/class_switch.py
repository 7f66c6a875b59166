"""A class that replaces a config's class does not inherit the old class's settings.

jsonargparse keeps a config's ``init_args`` when a later ``--model.objective DAPO`` (or a later config) changes the
class, wherever the new class accepts them. A config that spells out every setting (``--print_config`` writes GSPO's
ε 3e-4 / 4e-4 and ``seq-mean-token-mean``) would then make DAPO train silently with GSPO's clipping and aggregation.
Before parsing, a config whose class setting a later argument replaces by another class loses that setting's
``init_args`` (passed on as YAML text, as ``precision: auto`` is), and one line says so. Init args given on the
command line (``--model.objective.clip_high 0.3``) stay, before or after the class.
"""

from __future__ import annotations

import importlib

import yaml

#: RLModule's settings given by class path
CLASS_SETTINGS = ("objective", "engine", "advantage", "environment")
#: LightningCLI's subcommands, each a scope a config may hold settings under
SCOPES = ("fit", "validate", "test", "predict")


def _class(path) -> type | None:
    """The class a ``class_path`` names (a short name: lit_gspo's public API, as in ``--model.objective DAPO``)."""
    if not isinstance(path, str):
        return None
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module or "lit_gspo"), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _models(tree) -> list[dict]:
    """A parsed config's ``model`` sections (top level and under a subcommand)."""
    if not isinstance(tree, dict):
        return []
    scopes = [tree] + [tree[k] for k in SCOPES if isinstance(tree.get(k), dict)]
    return [scope["model"] for scope in scopes if isinstance(scope.get("model"), dict)]


def _spec_class(value) -> type | None:
    """The class of a setting's value (a class name, or a dict with ``class_path``); None when it names none."""
    if isinstance(value, dict):
        return _class(value.get("class_path"))
    return _class(value)


def _options(args: list[str]):
    """(index of the value, option name, value) of each ``--option value`` / ``--option=value`` in ``args``."""
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if eq:
            yield i, name, value
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            yield i + 1, name, args[i + 1]
            i += 2
        else:
            i += 1


def drop_replaced_init_args(args: list[str], config_tree) -> tuple[list[str], list[str]]:
    """``args`` with the ``init_args`` of every config's class setting that a later argument gives another class
    removed (``config_tree(value)`` parses a ``--config`` value: a file or YAML text); and one note per removal."""
    classes = []  # (index of the value, setting, class) in the order given
    configs = {}  # index of a --config value -> its parsed tree
    for at, name, value in _options(args):
        if name in ("--config", "-c"):
            configs[at] = tree = config_tree(value)
            for model in _models(tree):
                for setting in CLASS_SETTINGS:
                    if _spec_class(model.get(setting)) is not None:
                        classes.append((at, setting, _spec_class(model[setting])))
        elif name.startswith("--model.") and name[len("--model.") :] in CLASS_SETTINGS:
            spec = yaml.safe_load(value) if value.lstrip().startswith("{") else value
            if _spec_class(spec) is not None:
                classes.append((at, name[len("--model.") :], _spec_class(spec)))
    out, notes = list(args), []
    for at, tree in configs.items():
        changed = False
        for model in _models(tree):
            for setting in CLASS_SETTINGS:
                spec, cls = model.get(setting), _spec_class(model.get(setting))
                later = [c for i, s, c in classes if s == setting and i > at]
                if (
                    cls is None
                    or not later
                    or later[-1] is cls
                    or not (isinstance(spec, dict) and spec.get("init_args"))
                ):
                    continue
                notes.append(
                    f"--model.{setting}: {later[-1].__name__} replaces {cls.__name__} of a --config, whose "
                    f"settings ({', '.join(spec['init_args'])}) are {cls.__name__}'s: {later[-1].__name__} "
                    "starts from its own defaults"
                )
                del spec["init_args"]
                changed = True
        if changed:
            text = yaml.safe_dump(tree, sort_keys=False)
            out[at] = f"{args[at].partition('=')[0]}={text}" if "=" in args[at] and args[at].startswith("-") else text
    return out, notes
