"""LightningCLI for ``RLModule``: ``lit-gspo fit --config configs/quickstart.yaml``.

The ``lit-gspo`` entry point is ``lit_gspo.tools.main``; ``lit_gspo.tools.ablate`` runs its fits through ``cli_main`` here.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import sys

import yaml
from jsonargparse import ArgumentParser, Namespace, set_parsing_settings
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.lightning import class_switch, run_dir, trainer_flags
from lit_gspo.lightning.checks import validation_schedule
from lit_gspo.lightning.component_errors import NamingInstantiator, component_error
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.lightning.foreign_names import foreign_hint
from lit_gspo.lightning.int_before_float import int_before_float, int_or_float_parameters, parameter_doc
from lit_gspo.lightning.module import RLModule
from lit_gspo.lightning.monitors import check_monitors, config_monitors, logged_names
from lit_gspo.lightning.predictions_file import PredictionsFile
from lit_gspo.lightning.schedule import ScheduleCadence
from lit_gspo.lightning.unknown_option import class_fields, unknown_option_hint

# importing registers every built-in stage, so class names resolve: `--model.objective GSPO`, `--model.engine LeanSampler`
from lit_gspo.rl import advantages, engines, envs  # noqa: F401
from lit_gspo.rl.config import Update
from lit_gspo.rl.objectives import OBJECTIVES
from lit_gspo.runtime import extras, user_errors
from lit_gspo.runtime.collectives import end_process_group
from lit_gspo.runtime.imports import import_path
from lit_gspo.runtime.own_context import run_in_own_context
from lit_gspo.runtime.user_errors import SettingsError

# `--help` shows each setting's doc, the string literal after it (lit_gspo/rl/config.py)
set_parsing_settings(docstring_parse_attribute_docstrings=True)

DEFAULT_VAL_EVERY_N_STEPS = 10

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,  # one CSV row per RL step
    "num_sanity_val_steps": -1,  # the sanity check over every held-out batch is val/reward at step 0
    "enable_model_summary": False,
}


def objective_hint(message: str) -> str:
    """What to add to a parser error about ``model.objective``: the registered names (jsonargparse only
    says the value is not an import path)."""
    if 'key "model.objective"' not in message:
        return ""
    names = ", ".join(sorted(cls.__name__ for cls in OBJECTIVES.values()))
    return (
        f"\n  Known objectives: {names} (class names, e.g. `--model.objective GSPO`), or the dotted "
        "import path of your own Objective subclass (`--model.objective my_pkg.MyObjective`)."
    )


def nested_key_hint(message: str) -> str:
    """What to add to a parser error about a misspelled nested key (``--model.generation.num_generation``): the
    fields of that group (jsonargparse names the bad key and the group's class, not the keys it accepts)."""
    key = re.search(r'Parser key "([\w.]+)"', message)
    bad = re.search(r"(?:Option|Key) '([\w.]+)' is not (?:accepted|expected)", message)
    classes = re.findall(r"<class '([\w.]+)'>", message)
    if not (key and bad):
        return ""
    for path in classes:
        if path == "NoneType":
            continue
        try:
            cls = import_path(path)
            fields = class_fields(cls)
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
        close = difflib.get_close_matches(bad.group(1), fields, n=1)
        return (
            f"\n  Valid fields of {key.group(1)}: {', '.join(fields)}"
            + (f" (did you mean {key.group(1)}.{close[0]}?)" if close else "")
            + (f"\n  {foreign}" if (foreign := foreign_hint(bad.group(1))) else "")
        )
    return ""


def one_line_value_error(message: str) -> str:
    """jsonargparse's error for a value no type accepts (a key, the union's subtypes, one line per subtype, the value)
    as one line: ``--trainer.precision 7: expected one of 64, 32, 16, 'bf16-mixed', ... or null``; an error that is not
    "expected a <type>" (an ambiguous class name) is kept as it is."""
    head = re.match(r'Parser key "([^"]+)":\n', message)
    if not head:
        return message
    given = re.search(r"(?:Given value|Got value): (.*)", message)
    errors = re.findall(r"^\s+- (.*)$", message, re.M) or re.findall(r"^\s+(Expected a .*?)\. Got value", message, re.M)
    if not given or not errors:
        return message
    literals = [
        v.strip() for e in errors for inner in re.findall(r"typing\.Literal\[(.*)\]", e) for v in inner.split(",")
    ]
    types = [t.rpartition(".")[2] for e in errors for t in re.findall(r"<class '([\w.]+)'>", e) if t != "NoneType"]
    others = [e for e in errors if not e.startswith("Expected a ") and "Does not validate against" not in e]
    valid = ([f"one of {', '.join(dict.fromkeys(literals))}"] if literals else []) + [
        f"{'an' if t[0] in 'aeiou' else 'a'} {t}" for t in types
    ]
    nullable = " or null" if any("NoneType" in e for e in errors) else ""
    paths = [p for e in errors for p in re.findall(r"^Expected a dot import path string: (\S+)$", e)]
    if paths:  # a function or class by name (rewards): a dotted path, lit_gspo's by its full path
        others = [e for e in others if not e.startswith("Expected a dot import path")]
        valid.append("a dot import path" + (f" such as {full_path(paths[0])}" if full_path(paths[0]) else ""))
    if not others and not valid:
        return message
    what = "; ".join(others) if others else "expected " + " or ".join(valid) + nullable
    models = [p for p in paths if "/" in p or os.sep in p]  # a hub id or a directory, as TRL's reward_funcs takes
    if models:
        what += (
            f"; a reward model (TRL's reward_funcs takes its id) is {{class_path: lit_gspo.rl.rewards.RewardModel, "
            f"init_args: {{model: {models[0]}}}}}"
        )
    return f"--{head.group(1)} {given.group(1).strip()}: {what}"


def full_path(name: str) -> str | None:
    """``lit_gspo.rl.rewards.OverlongPenalty`` for ``OverlongPenalty``: the dotted path of a name lit_gspo exports."""
    import lit_gspo

    module = lit_gspo._EXPORTS.get(name) if "." not in name else None
    return f"{module}.{name}" if module else None


def nested_value_error(message: str) -> str | None:
    """jsonargparse's error about a parameter of a class a setting names, nested in the setting's union errors, as one
    line naming the full option: a bad value (``--model.objective.kl_estimator bogus: expected one of 'k1', 'k2',
    'k3'``) or an unknown parameter (``--model.objective.clip_lo: not a parameter of GSPO; ...``); None for another
    error."""
    lines = message.splitlines()
    head = re.match(r'Parser key "([^"]+)"', lines[0]) if lines else None
    if not head:
        return None
    keys, class_path = [head.group(1)], None
    for line in lines[1:]:
        nested = re.match(r'\s*(?:- )?Parser key "([^"]+)"', line)
        given = re.search(r"Problem with given class_path '([\w.]+)'", line)
        bad_value = re.match(r"\s*(?:- )?(?:.*: )?--([\w.]+) (\S.*?): (expected .*?)(?:\. Got value: .*)?$", line)
        unknown = re.match(r"\s*(?:- )?(?:Option|Key) '([\w.]+)' is not (?:accepted|expected)", line)
        if nested:
            keys.append(nested.group(1))
        elif given:
            class_path = given.group(1)
        elif bad_value:
            name, value, what = bad_value.groups()
            return f"--{'.'.join(keys)}.{name} {value}: {what}"
        elif unknown and class_path:
            return _unknown_parameter(".".join(keys), unknown.group(1), class_path)
    return None


def _unknown_parameter(option: str, name: str, class_path: str) -> str | None:
    try:
        cls = import_path(class_path)
        fields = class_fields(cls)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    close = difflib.get_close_matches(name, fields, n=1)
    return (
        f"--{option}.{name}: not a parameter of {cls.__name__}; its parameters: {', '.join(fields) or 'none'}"
        + (f" (did you mean --{option}.{close[0]}?)" if close else "")
        + (f"; {foreign}" if (foreign := foreign_hint(name)) else "")  # one line, as every error about a value
    )


class RLArgumentParser(LightningArgumentParser):
    """Parser errors about the objective list the objectives that exist, about a misspelled nested key the valid
    fields, about a class path of a missing optional package the extra to install, about an unknown option or YAML
    key where a setting of that name is (``unknown_option.py``: another library's name, the same name elsewhere, close spellings);
    keeps its subcommands action."""

    subcommands_action = None

    def __init__(self, *args, **kwargs):
        # no abbreviations: a misspelled key that happens to be a prefix of a field (num_generation) is an error too
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_class_arguments(self, class_type, nested_key=None, *args, skip=None, **kwargs):
        """jsonargparse's, except that a parameter whose annotation is a union of ``int`` and ``float`` parses an int
        as an int, however ``typing`` ordered the union (``lit_gspo.lightning.int_before_float``). Also the parser
        of a class given by ``class_path`` (a callback, a logger), which jsonargparse builds of this class."""
        exact = int_or_float_parameters(class_type) if inspect.isclass(class_type) else {}
        added = super().add_class_arguments(class_type, nested_key, *args, skip={*(skip or ()), *exact}, **kwargs)
        container = (self.groups or {}).get(nested_key, self)
        for name, (hint, default) in exact.items():
            key = f"{nested_key}.{name}" if nested_key else name
            container.add_argument(
                f"--{key}", type=int_before_float(hint), default=default, help=parameter_doc(class_type, name)
            )
            added.append(key)
        return added

    def error(self, message: str, ex: Exception | None = None):
        if self.subcommands_action is not None:  # jsonargparse lists the first 5 subcommands and "...": all of them
            every = "{" + ",".join(self.subcommands_action.choices) + "}"
            message = re.sub(r'(expected "subcommand" to be one of )\{[^}]*\}', lambda m: m.group(1) + every, message)
        nested = nested_value_error(message)
        if nested and self.exit_on_error and not user_errors.debug_requested():
            user_errors.parser_error(nested)
        hint = (
            objective_hint(message)
            + nested_key_hint(message)
            + extras.hint_for(message)
            + unknown_option_hint(message, self.option_names())
        )
        if not hint:  # a hint reads the whole message; without one, the message as one line
            message = one_line_value_error(message)
        if self.exit_on_error and not user_errors.debug_requested():
            user_errors.parser_error(message + hint)  # one error, not the usage dump (lit_gspo/runtime/user_errors.py)
        return super().error(message + hint, ex)

    def option_names(self) -> list[str]:
        """The ``--`` options this parser and its subcommands take (argparse keeps them in ``_option_string_actions``
        only); a YAML key a subcommand does not know is reported by the top parser."""
        own = [option for option in getattr(self, "_option_string_actions", {}) if option.startswith("--")]
        subcommands = self.subcommands_action.choices.values() if self.subcommands_action is not None else []
        nested = [
            option for parser in subcommands if isinstance(parser, RLArgumentParser) for option in parser.option_names()
        ]
        return list(dict.fromkeys([*own, *nested]))

    def add_subcommands(self, *args, **kwargs):
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action


def _class_of(subclass_cfg) -> type | None:
    path = subclass_cfg.get("class_path") if isinstance(subclass_cfg, Namespace) else None
    try:
        return import_path(path or "")
    except (ImportError, AttributeError):
        return None


class RLCLI(LightningCLI):
    """LightningCLI with CSV metrics by default (``<default_root_dir>/lightning_logs/version_N/metrics.csv``, continued by
    a resume), checkpoints, and a
    progress bar over RL steps (``lit_gspo.lightning.progress.RLProgressBar``).

    Checkpoints (``lit_gspo.lightning.callbacks.last_checkpoint``): ``<default_root_dir>/checkpoints/last.ckpt`` every
    ``checkpoint_every_n_steps`` steps, written atomically; resume with ``--ckpt_path last``.
    A strategy other than DDP and FSDP2 (``ModelParallelStrategy``) is refused at start (``strategy.py``).

    ``other_subcommands`` (name → parser) are listed in ``--help`` and in the "expected subcommand" error
    beside fit/validate/test/predict; they are run by the entry point (``lit_gspo.tools.main``), not here.
    """

    def __init__(
        self,
        *args,
        parser_class: type[LightningArgumentParser] = RLArgumentParser,
        other_subcommands: dict[str, ArgumentParser] | None = None,
        **kwargs,
    ) -> None:
        self.other_subcommands = dict(other_subcommands or {})
        given = kwargs.get("args")
        if given is None or isinstance(given, (list, tuple)):  # rewritten before jsonargparse reads them
            argv = sys.argv[1:] if given is None else list(given)
            argv, note = resolve_auto_precision_args(argv)  # --trainer.precision auto: resolved for this machine
            argv, notes = class_switch.drop_replaced_init_args(argv, _config_tree)  # a replaced class's settings
            for line in ([note] if note else []) + notes:
                rank_zero_info(line)
            if given is None:
                sys.argv[1:] = argv
            else:
                kwargs["args"] = argv
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``; ``validate``, ``test`` (``val/reward`` / ``test/reward`` of a ``.ckpt`` or an ``hf_model/``
        directory given as ``--ckpt_path``) and ``predict`` (their completions and rewards, written to
        ``lightning_logs/predict/predictions.jsonl``: ``predictions_file.py``)."""
        return {name: LightningCLI.subcommands()[name] for name in class_switch.SCOPES}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        for name, parser in self.other_subcommands.items():
            self.parser.subcommands_action.add_subcommand(name, parser, help=parser.description)

    def before_instantiate_classes(self) -> None:
        if self.subcommand in self.other_subcommands:
            self.parser.error(f"`{self.subcommand}` must come first: lit-gspo {self.subcommand} --help")
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        user_errors.mark_starting()
        self.name_component_errors()
        trainer_flags.refuse_unsupported(cfg.trainer)
        map_top_level_optimisation(cfg)
        schedule_validation(cfg.model, cfg.trainer)
        map_trainer_flags(cfg.model, cfg.trainer)
        check_settings_groups(cfg.model)
        check_rows_per_step(cfg.model, cfg.get("data"))
        check_plateau(cfg.model)
        atomic_strategy(cfg.trainer)
        rl_step_progress_bars(cfg.trainer)
        if (
            self.subcommand == "fit"
        ):  # one run per directory: compare with the run there (lit_gspo/lightning/run_dir.py)
            run_dir.place_fit(self)

    def name_component_errors(self) -> None:
        """A class the config names that refuses a value in its ``__init__`` (``--model.objective.clip_low -1``) is
        reported naming the option (``lit_gspo.lightning.component_errors``)."""
        self.component_instantiator = NamingInstantiator(
            lambda: self.config[self.subcommand] if self.subcommand else self.config
        )
        self.parser.add_instantiator(self.component_instantiator, object, subclasses=True)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as exc:
            self.raise_one_line(exc)

    def raise_one_line(self, exc: Exception) -> None:
        """``exc``, raised while building the config's classes, as one line naming the option when it is a class or
        settings group refusing a value (``--model.objective.clip_low -1``, ``--model.generation.num_generations 0``),
        not jsonargparse's dump of the parsed namespace; another error as it is."""
        named = component_error(exc, getattr(self, "component_instantiator", None))
        if named is not None:
            raise named from named.__cause__  # the class's own error (shown with --debug)
        inner = exc.__cause__ or exc.__context__
        while inner is not None and not user_errors.is_user_error(inner):
            inner = inner.__cause__ or inner.__context__
        if not isinstance(exc, ValueError) or inner is None or user_errors.is_user_error(exc):
            raise exc
        found = re.search(r"<class 'lit_gspo\.[\w.]+\.(\w+)'>", str(exc))
        group = next(
            (
                f"--model.{name}: "
                for name, p in inspect.signature(RLModule.__init__).parameters.items()
                if found and re.search(rf"\b{found.group(1)}\b", str(p.annotation))
            ),
            "",
        )
        raise SettingsError(f"{group}{inner}".strip()) from exc

    def before_fit(self) -> None:
        """Before the first validation: a monitor the run never logs (``lit_gspo.lightning.monitors``), a value the
        optimiser or the schedule refuses, a hub that cannot take the push."""
        check_monitors(logged_names(self.model), config_monitors(self.config.fit))
        check_optimisation(self.model)
        repo_id = self.config.fit.get("push_to_hub")
        if repo_id:
            from lit_gspo.models.push import check_can_push

            check_can_push(repo_id)

    def validate(self, model, ckpt_path=None, **kwargs):
        return self.trainer.validate(model, ckpt_path=load_export(model, ckpt_path), **kwargs)

    def test(self, model, ckpt_path=None, **kwargs):
        return self.trainer.test(model, ckpt_path=load_export(model, ckpt_path), **kwargs)

    def predict(self, model, ckpt_path=None, **kwargs):
        return self.trainer.predict(model, ckpt_path=load_export(model, ckpt_path), **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--checkpoint_every_n_steps",
            type=int,
            default=50,
            help="save <default_root_dir>/checkpoints/last.ckpt every n RL steps "
            "(with trainer.enable_checkpointing; 0 = at the end of each epoch)",
        )
        parser.add_argument(
            "--push_to_hub",
            type=str | None,
            default=None,
            help="after training, upload <default_root_dir>/hf_model (and a LoRA run's hf_adapter, "
            "into adapter/) to this Hugging Face Hub model repo, e.g. my-name/my-model; off by "
            "default. Checked before training: fails at once when the hub is offline",
        )
        parser.add_argument(
            "--hub_private",
            type=bool,
            default=False,
            help="with --push_to_hub: create the repo private (an existing repo keeps its visibility)",
        )

    def after_fit(self) -> None:
        repo_id = self.config.fit.get("push_to_hub")
        if repo_id and self.trainer.is_global_zero:
            from lit_gspo.models.push import push_export

            for url in push_export(self.trainer.default_root_dir, repo_id, private=self.config.fit.get("hub_private")):
                print(f"pushed to the hub: {url}")

    def instantiate_trainer(self, **kwargs):
        """The Trainer with lit_gspo's defaults: ``RunCSVLogger`` (a resume continues the run's ``metrics.csv``),
        atomic checkpoints with ``<root>/checkpoints/last.ckpt``, and the RL-step progress bar."""
        from lit_gspo.lightning.callbacks.last_checkpoint import configure_checkpointing

        cfg = self.config_init[self.subcommand] if self.subcommand else self.config_init
        config = {**cfg["trainer"], **kwargs}
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        if config.get("logger") in (None, True):
            config["logger"] = run_dir.default_logger(
                self.subcommand, config.get("default_root_dir") or os.getcwd(), cfg.get("ckpt_path")
            )  # validate/test: never a fit's version_N
        if self.subcommand in (None, "fit"):  # None: cli_main(run=False), which builds a fit
            configure_checkpointing(config, callbacks, cfg.get("checkpoint_every_n_steps", 50))
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in callbacks):
            callbacks.append(PredictionsFile())  # the CLI keeps nothing trainer.predict returns
        add_progress_bar(config, callbacks)
        config["callbacks"] = callbacks
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            return super().instantiate_trainer(**config)
        except MisconfigurationException as exc:  # a Trainer flag's value Lightning refuses: its message, one line
            raise SettingsError(" ".join(str(exc).split())) from exc


def _config_tree(value: str) -> dict:
    """A ``--config`` value (a file or YAML text) parsed, ``{}`` when it is neither."""
    try:
        tree = yaml.safe_load(open(value).read() if os.path.isfile(value) else value)
    except (OSError, yaml.YAMLError):
        return {}
    return tree if isinstance(tree, dict) else {}


def _trainer_key(tree: dict, key: str):
    """``trainer.<key>`` of a parsed config (also under a subcommand), None when absent."""
    for scope in [tree] + [v for k, v in tree.items() if k in class_switch.SCOPES and isinstance(v, dict)]:
        trainer = scope.get("trainer")
        if isinstance(trainer, dict) and key in trainer:
            return trainer[key]
    return None


def _device_type(accelerator) -> str:
    """The device ``trainer.accelerator`` means here (``auto``: CUDA when there is one, else the CPU)."""
    import torch

    name = str(accelerator).lower() if isinstance(accelerator, str) else "auto"
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_auto_precision_args(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` with ``precision: auto`` (``--trainer.precision auto``, or in a ``--config``) resolved for the
    accelerator the same ``args`` ask for (``lit_gspo.runtime.hardware.resolve_auto_precision``: bf16-mixed where bf16
    is native, 32-true elsewhere), and the one line that says so (None when nothing was ``auto``). A config file whose
    precision is ``auto`` is passed on as its YAML text with the value resolved."""
    from lit_gspo.runtime.hardware import AUTO, resolve_auto_precision

    accelerator, autos, i = None, [], 0
    while i < len(args):  # the accelerator asked for (the last one given wins), and where `auto` is
        arg = args[i]
        value = args[i + 1] if "=" not in arg and i + 1 < len(args) else arg.partition("=")[2]
        name = arg.partition("=")[0]
        if name in ("--config", "-c"):
            tree = _config_tree(value)
            accelerator = _trainer_key(tree, "accelerator") or accelerator
            if _trainer_key(tree, "precision") == AUTO:
                autos.append((i, "config"))
        elif name == "--trainer.accelerator":
            accelerator = value
        elif name == "--trainer.precision" and value == AUTO:
            autos.append((i, "=" if "=" in arg else "flag"))
        i += 2 if "=" not in arg and name in ("--config", "-c", "--trainer.accelerator", "--trainer.precision") else 1
    if not autos:
        return args, None
    precision, note = resolve_auto_precision(_device_type(accelerator))
    out = list(args)
    for i, how in reversed(autos):
        if (
            how == "config"
        ):  # the config as YAML text with the value resolved (jsonargparse checks each config it loads)
            at = i if "=" in out[i] else i + 1
            tree = _config_tree(out[at].partition("=")[2] if at == i else out[at])
            for scope in [tree] + [v for k, v in tree.items() if k in class_switch.SCOPES and isinstance(v, dict)]:
                if isinstance(scope.get("trainer"), dict) and scope["trainer"].get("precision") == AUTO:
                    scope["trainer"]["precision"] = precision
            text = yaml.safe_dump(tree, sort_keys=False)
            out[at] = f"{out[i].partition('=')[0]}={text}" if at == i else text
        elif how == "=":
            out[i] = f"--trainer.precision={precision}"
        else:
            out[i + 1] = precision
    return out, note


def settings_group(model, name: str):
    """The parsed ``model.<name>`` settings group (a dataclass's Namespace), created empty when not given."""
    group = model.get(name)
    if group is None:
        group = model[name] = Namespace()
    return group.get("init_args", group)


def schedule_validation(model, trainer) -> None:
    """``model.validation.every_n_steps`` is Lightning's ``trainer.val_check_interval`` in RL steps (one Lightning
    batch is one RL step, so ``check_val_every_n_epoch`` is None). Either may be given; both, differing, are refused in
    one line."""
    validation = settings_group(model, "validation")
    n, interval = validation.get("every_n_steps"), trainer.get("val_check_interval")
    if n is not None and interval is not None and validation_schedule(n)["val_check_interval"] != interval:
        raise ValueError(
            f"--model.validation.every_n_steps {n} and --trainer.val_check_interval {interval} disagree: "
            "give one (both count RL steps)"
        )
    if n is None and isinstance(interval, float):
        return  # a fraction of a data epoch: Lightning's own meaning, with check_val_every_n_epoch
    every_epochs = trainer.get("check_val_every_n_epoch")
    if every_epochs not in (None, 1):
        raise SettingsError(
            f"--trainer.check_val_every_n_epoch {every_epochs}: validation counts RL steps here (one "
            "Lightning batch is one RL step): use --model.validation.every_n_steps N"
        )
    if n is None:
        n = DEFAULT_VAL_EVERY_N_STEPS if interval is None else interval
    validation["every_n_steps"] = n
    for key, value in validation_schedule(n).items():
        trainer[key] = value


def check_settings_groups(model) -> None:
    """A settings group whose own check fails (``--model.generation.num_generations 0``,
    ``--model.policy.warm_start.steps -1``): one line naming the group, at start (``lit_gspo/rl/config.py``'s
    ``__post_init__`` checks, run on the parsed values)."""
    import typing

    for name, hint in typing.get_type_hints(RLModule.__init__).items():
        check_group(f"--model.{name}", hint, model.get(name))


def check_group(option: str, hint, group) -> None:
    """Build ``hint``'s plain-valued dataclass of ``lit_gspo/rl/config.py`` from ``group`` (its nested groups first), so
    that each group's ``__post_init__`` runs now; other settings (class specs such as ``update.mismatch``) are built at
    instantiation."""
    import typing

    cls = next((c for c in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(c)), None)
    if (
        cls is None
        or cls.__module__ != "lit_gspo.rl.config"
        or not isinstance(group, Namespace)
        or "class_path" in group
    ):
        return
    hints = typing.get_type_hints(cls)
    values = group.as_dict()
    for key in list(values):
        check_group(f"{option}.{key}", hints.get(key), group.get(key))
        if isinstance(group.get(key), Namespace):
            values.pop(key)  # checked on its own
    try:
        cls(**values)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{option}: {exc}") from exc


def map_trainer_flags(model, trainer) -> None:
    """Lightning's optimisation flags, which assume automatic optimisation, mapped to lit_gspo's own settings or refused in
    one line naming them (RLModule optimises by hand: K epochs × M minibatches per RL step, ``lit_gspo.rl.learn.learner``).

    ``gradient_clip_val`` → ``model.update.max_grad_norm`` (``gradient_clip_algorithm: norm`` only; a max_grad_norm
    other than its default and the clip value is refused);
    ``accumulate_grad_batches`` → refused: ``model.update.micro_batch_size`` accumulates within a minibatch."""
    clip, algorithm = trainer.get("gradient_clip_val"), trainer.get("gradient_clip_algorithm")
    if algorithm not in (None, "norm"):
        raise ValueError(
            f"--trainer.gradient_clip_algorithm {algorithm}: lit_gspo clips the gradient norm only "
            "(--model.update.max_grad_norm); use norm, or leave it unset"
        )
    if clip is not None:
        update = settings_group(model, "update")
        given = update.get("max_grad_norm")
        if given not in (None, Update.max_grad_norm) and float(given) != float(clip):
            raise ValueError(
                f"--trainer.gradient_clip_val {clip} and --model.update.max_grad_norm {given} disagree: "
                "give one (both clip the gradient norm of each optimiser step)"
            )
        update["max_grad_norm"] = float(clip) if clip > 0 else None  # Lightning's 0: no clipping
        trainer["gradient_clip_val"], trainer["gradient_clip_algorithm"] = None, None
    # accumulate_grad_batches: refused in one line by trainer_flags.refuse_unsupported


def _class_name(value) -> str:
    """A parsed optimiser/scheduler setting as a user would type it (``torch.optim.SGD``)."""
    if isinstance(value, Namespace):
        return str(value.get("class_path"))
    return getattr(value, "__qualname__", None) or type(value).__name__


def map_top_level_optimisation(cfg) -> None:
    """LightningCLI's top-level ``--optimizer X`` / ``--lr_scheduler X`` (``optimizer:``/``lr_scheduler:`` in YAML) are
    read as ``model.optimizer`` / ``model.lr_scheduler``, which RLModule steps by hand (a top-level one would be
    LightningCLI's own ``configure_optimizers``, which it skips or replaces silently). The config then records them under
    ``model.`` (``run_config.yaml``). Given both ways: refused in one line."""
    model = cfg.model
    for key in ("optimizer", "lr_scheduler"):
        given = cfg.get(key)
        if given is None:
            continue
        own = model.get(key)
        if isinstance(own, Namespace):  # given in the config or on the command line (the defaults are callables / None)
            raise SettingsError(
                f"--{key} {_class_name(given)} and --model.{key} {_class_name(own)} both given: give one, "
                f"as --model.{key} (RLModule optimises by hand; the top-level --{key} is read as "
                f"--model.{key})"
            )
        model[key] = given
        cfg[key] = None
        rank_zero_info(f"note: --{key} {_class_name(given)} read as --model.{key} (recorded there in the run's config)")


def check_plateau(model) -> None:
    """``model.update.scheduler_interval``/``scheduler_frequency`` other than the defaults without a schedule or with a
    ReduceLROnPlateau are refused (``lit_gspo.lightning.schedule``). A ReduceLROnPlateau: torch's (no monitor) or a
    monitor that is neither ``val/*`` nor ``train/*`` is refused in one line at start; the name itself once the module
    is built (``before_fit``, ``lit_gspo.lightning.monitors``)."""
    import torch

    from lit_gspo.lightning.plateau import check_plateau_monitor

    scheduler = model.get("lr_scheduler")
    cls = _class_of(scheduler)
    interval, frequency = (
        _group_value(model, "update", "scheduler_interval"),
        _group_value(model, "update", "scheduler_frequency"),
    )
    cadence = ScheduleCadence(interval or "step", 1 if frequency is None else frequency)
    cadence.check(cls or scheduler)  # at start, not when the fit configures its optimiser
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # here only its presence and its split: which val/* names the run logs (each reward function's mean, pass@k, a
        # multi-turn environment's metrics) is known once the module is built (``before_fit``'s ``check_monitors``)
        check_plateau_monitor((scheduler.get("init_args") or Namespace()).get("monitor"), None)


def check_optimisation(module) -> None:
    """The module's optimiser and schedule built once on a placeholder parameter, before the step-0 validation: a value
    their classes refuse (``--model.optimizer.lr -1``) is one line naming the option now
    (``lit_gspo.lightning.component_errors``), not when the fit configures them. Any other failure is left to that."""
    import torch

    from lit_gspo.lightning.component_errors import ComponentError

    try:
        optimizer = module.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
        if module.scheduler_factory is not None:
            module.scheduler_factory(optimizer)
    except ComponentError:
        raise
    except Exception:  # e.g. an optimiser that needs the real parameters' device: configure_optimizers will say
        return


def _group_value(model, name: str, key: str):
    """``model.<name>.<key>`` as parsed, None when not given (the group left as it is)."""
    group = model.get(name)
    group = group.get("init_args", group) if isinstance(group, Namespace) else None
    return group.get(key) if isinstance(group, Namespace) else None


def check_rows_per_step(model, data) -> None:
    """``model.update.num_minibatches`` M cuts each RL step's rows (prompts_per_step × num_generations per process) in M
    minibatches: more minibatches than rows is refused in one line."""
    from lit_gspo.rl.config import Generation

    if data is None:
        return
    minibatches = _group_value(model, "update", "num_minibatches") or 1
    generations = _group_value(model, "generation", "num_generations") or Generation().num_generations
    prompts = data.get("prompts_per_step")
    if isinstance(prompts, int) and prompts < 1:
        raise SettingsError(f"--data.prompts_per_step {prompts}: must be >= 1 (prompts sampled per RL step)")
    if isinstance(prompts, int) and minibatches > prompts * generations:
        raise SettingsError(
            f"--model.update.num_minibatches {minibatches}: more minibatches than the {prompts * generations} "
            f"rows of an RL step (--data.prompts_per_step {prompts} × --model.generation.num_generations "
            f"{generations}); use at most {prompts * generations}, or more prompts per step"
        )
    rows = prompts * generations if isinstance(prompts, int) else None
    if rows and -(-rows // -(-rows // minibatches)) < minibatches:  # ⌈N/M⌉ rows each leave fewer than M minibatches
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        raise SettingsError(
            f"--model.update.num_minibatches {minibatches}: the {rows} rows of an RL step cut in minibatches of "
            f"⌈{rows}/{minibatches}⌉ = {-(-rows // minibatches)} make only {-(-rows // -(-rows // minibatches))} "
            f"optimiser steps; use one that divides {rows} ({', '.join(map(str, divisors))})"
        )


def rl_step_progress_bars(trainer) -> None:
    """A ``RichProgressBar`` given as a callback becomes ``RLRichProgressBar`` (same arguments): it counts RL steps."""
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, Namespace) and callback.get("class_path") in (
            "lightning.pytorch.callbacks.RichProgressBar",
            "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar",
        ):
            callback["class_path"] = "lit_gspo.lightning.progress.RLRichProgressBar"


def atomic_strategy(trainer) -> None:
    """``ModelParallelStrategy`` (FSDP2) given by class path becomes ``AtomicModelParallelStrategy`` (its distributed
    checkpoints are swapped in whole: ``lit_gspo.lightning.strategy``), and mesh sizes left ``auto`` mean FSDP2 over every
    process: ``data_parallel_size`` = nodes × devices, ``tensor_parallel_size`` 1. (Lightning's ``auto`` makes the mesh
    tensor-parallel over the devices; lit_gspo shards over data-parallel ranks only.)"""
    strategy = trainer.get("strategy")
    plain = (
        "lightning.pytorch.strategies.ModelParallelStrategy",
        "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy",
        "ModelParallelStrategy",
    )
    atomic = "lit_gspo.lightning.strategy.AtomicModelParallelStrategy"
    if isinstance(strategy, str) and strategy in plain + (atomic,):
        strategy = trainer["strategy"] = Namespace(class_path=atomic, init_args=Namespace())
    if not isinstance(strategy, Namespace) or strategy.get("class_path") not in plain + (atomic,):
        return
    strategy["class_path"] = atomic
    sizes = strategy.get("init_args") or Namespace()
    if sizes.get("tensor_parallel_size", "auto") == "auto":
        sizes["tensor_parallel_size"] = 1
    if sizes.get("data_parallel_size", "auto") == "auto":
        processes = (trainer.get("num_nodes") or 1) * device_count(trainer.get("devices"), trainer.get("accelerator"))
        sizes["data_parallel_size"] = processes // sizes["tensor_parallel_size"]
    strategy["init_args"] = sizes


def device_count(devices, accelerator) -> int:
    """How many devices a Trainer's ``devices`` setting means on one node (``auto``/-1: all the accelerator has)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, int) and devices >= 0:
        return devices
    import torch

    on_gpu = accelerator in ("gpu", "cuda") or (accelerator in (None, "auto") and torch.cuda.is_available())
    return torch.cuda.device_count() if on_gpu else 1


def load_export(model, ckpt_path):
    """``--ckpt_path DIR`` of a Hugging Face export (``<run>/hf_model``): its weights into ``model``'s policy (the run's
    warm start is in them), and no Lightning checkpoint to restore. A ``.ckpt`` is Lightning's to restore."""
    from pathlib import Path

    if ckpt_path is None or not Path(ckpt_path).is_dir():
        return ckpt_path
    from lit_gspo.lightning.export import load_trained_policy

    load_trained_policy(model, ckpt_path)
    return None


def add_progress_bar(config: dict, callbacks: list) -> None:
    """``RLProgressBar`` (RL steps n/N) in place of Lightning's default bar, unless the progress bar is off
    (``--trainer.enable_progress_bar false``) or the user gave a progress bar of their own (``callbacks``: the
    trainer's, a list however the config gave them)."""
    from lightning.pytorch.callbacks import ProgressBar

    from lit_gspo.lightning.progress import RLProgressBar

    if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(RLProgressBar())


def cli_main(
    args: list[str] | None = None, run: bool = True, other_subcommands: dict[str, ArgumentParser] | None = None
) -> RLCLI:
    """``args`` None: LightningCLI reads ``sys.argv``. A command that runs (``run``) runs in its own context and leaves
    nothing in the caller's (``lit_gspo.runtime.own_context``); ``run=False`` builds in the caller's, which fits
    next: the trainer's settings (``deterministic`` is one of torch's context variables) must still hold there."""
    if run:
        return run_in_own_context(_cli_main, args, run, other_subcommands)
    return _cli_main(args, run, other_subcommands)


def _cli_main(args: list[str] | None, run: bool, other_subcommands: dict[str, ArgumentParser] | None) -> RLCLI:
    cli = RLCLI(
        RLModule,
        PromptDataModule,
        seed_everything_default=0,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=run_dir.RunConfigCallback,  # also <root>/run_config.yaml, and in each checkpoint
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        other_subcommands=other_subcommands,
    )
    if run:  # finished on this rank (a failure raised above): ranks are done together
        # the engine (a vLLM) freed while the trainer's process group lives: `validate`/`test` keep it after their
        # loop, and vLLM's own teardown at exit would find its groups gone with the trainer's
        cli.model.collector.engine.close()
        if cli.trainer.world_size > 1:
            end_process_group()
    return cli
