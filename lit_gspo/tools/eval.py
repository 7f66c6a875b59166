"""``lit-gspo eval``: greedy accuracy, mean@n and pass@k of a run's policy, with the run's own settings.

    lit-gspo eval --ckpt runs/quickstart/hf_model                      # the config `fit` saved in the run
    lit-gspo eval --config configs/quickstart.yaml --ckpt runs/quickstart/checkpoints/last.ckpt --samples 16
    lit-gspo eval --ckpt smollm2-135m-instruct --data.train_source arithmetic \
        --model.rewards '[{class_path: lit_gspo.rl.rewards.AnswerMatch, init_args: {mode: last_number}}]'

The arguments are ``lit-gspo fit``'s (``--config``, ``--model.*``, ``--data.*``, ``--trainer.*``, read by the
same parser, so a fit YAML reads unchanged) plus the evaluation's own (``--ckpt``, ``--samples``, ``--k``, ...).
``--ckpt`` is a Lightning ``.ckpt`` of a run (the policy weights are loaded into the model the config builds)
or anything ``model.policy.name`` takes (an HF directory such as a run's ``hf_model/``, a ``.gguf``, a GGUF alias, a
hub id). Without ``--config``, the config of the run that wrote the checkpoint is read (the one saved inside the
``.ckpt``, beside the export, or the run's ``run_config.yaml``: ``lit_gspo.lightning.run_dir.config_for``), and the first line
says which; a ``--config`` that changes the run's seed, rewards or data is refused unless those are given as options.

The prompts are the data module's held-out rows (``--split validation``, as ``val/reward``; ``--split train``
for the training rows); ``--data.val_source FILE`` scores every row of a file. Sampling and scoring are the
trainer's: ``model.environment``, ``model.engine``, ``model.rewards`` and ``model.generation`` (greedy
and sampled completions get ``val_max_new_tokens``), under ``trainer.precision`` (``*-mixed``: autocast; ``*-true``:
the weights cast). The samples follow the run's sampled validation (``model.validation.num_generations`` and its
temperature, k, threshold, batch and seeded stream) unless options say otherwise, so a checkpoint's mean@n and pass@k
are the ``val/reward`` and ``val/pass@k`` its run logged at that step. A run on W processes validated each batch in W
shares, each drawn from its process's own stream: ``eval`` samples the same shares from the same streams, one after
the other (``--world_size``, read from the checkpoint or the export by default). Prints a table and
writes JSON (``--output``; default ``<checkpoint>.eval.json`` next to a local checkpoint, else
``<model name>.eval.json`` in the working directory).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import warnings
from pathlib import Path
from typing import Literal

import torch
from jsonargparse import ArgumentParser

from lit_gspo.lightning import run_dir
from lit_gspo.lightning.cli import RLCLI, TRAINER_DEFAULTS
from lit_gspo.lightning.quiet import CLI_ARGS_WARNING
from lit_gspo.lightning.seed import VALIDATION_STREAM, stream_seed
from lit_gspo.models.loading import load_checkpoint_policy
from lit_gspo.rl.evaluate import evaluate, format_table
from lit_gspo.runtime import user_errors
from lit_gspo.runtime.user_errors import SettingsError

DESCRIPTION = "Greedy accuracy, mean@n and pass@k of a checkpoint or HF model on a dataset, with the run's rewards."


def make_parser() -> ArgumentParser:
    """What ``lit-gspo --help`` lists for ``eval`` (``lit-gspo eval --help`` prints the full parser)."""
    return ArgumentParser(prog="lit-gspo eval", description=DESCRIPTION)


class EvalCLI(RLCLI):
    """``RLCLI``'s parser plus the evaluation's arguments; builds the model and data module, not a Trainer."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--ckpt",
            type=str | None,
            default=None,
            help="a run's .ckpt, or an HF model dir (e.g. <run>/hf_model), .gguf, GGUF alias or hub id "
            "(null: model.policy.name as configured)",
        )
        parser.add_argument(
            "--split",
            type=Literal["validation", "train"],
            default="validation",
            help="the data module's held-out rows (as val/reward) or its training rows",
        )
        parser.add_argument("--limit", type=int | None, default=None, help="only the first n rows of the split")
        parser.add_argument("--greedy", type=bool, default=True, help="score one greedy completion per prompt")
        parser.add_argument(
            "--samples",
            type=int | None,
            default=None,
            help="n completions per prompt for mean@n and pass@k (null: model.validation.num_generations, as the run's "
            "sampled validation, else model.generation.num_generations; 0: none)",
        )
        parser.add_argument(
            "--k",
            type=list[int] | None,
            default=None,
            help="the k of pass@k, e.g. [1,8] (null: model.validation.pass_at_k for its n, else 1, 2, 4, ... up to n)",
        )
        parser.add_argument(
            "--temperature",
            type=float | None,
            default=None,
            help="sampling temperature (null: model.validation.temperature, else model.generation.temperature)",
        )
        parser.add_argument(
            "--threshold",
            type=float | None,
            default=None,
            help="a completion is solved when its reward is >= this (null: model.validation.pass_threshold, 1.0)",
        )
        parser.add_argument(
            "--greedy_batch_size",
            type=int | None,
            default=None,
            help="prompts per greedy generate call (null: data.val_batch_size)",
        )
        parser.add_argument(
            "--sample_batch_size",
            type=int | None,
            default=None,
            help="prompts per sampled generate call, n completions each (null: data.val_batch_size when the run "
            "validates sampled, as its validation does; else data.prompts_per_step)",
        )
        parser.add_argument(
            "--world_size",
            type=int | None,
            default=None,
            help="sample each batch as this many processes validate it, process r taking prompts r, r+W, ... from its "
            "own stream (null: as many as the run of --ckpt had, read from it; 1 for a model of no run)",
        )
        parser.add_argument(
            "--output", type=str | None, default=None, help="the JSON file (null: next to the checkpoint)"
        )
        parser.add_argument("--show", type=int, default=3, help="print this many greedy completions")
        parser.add_argument(
            "--device", type=str | None, default=None, help="e.g. cpu, cuda, cuda:1 (null: from trainer.accelerator)"
        )
        # a fit config, and the config.yaml a fit saves, carry these: read, not used
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="fit's resume path: ignored here")
        parser.add_argument("--weights_only", type=bool | None, default=None, help="fit's: ignored here")

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        ckpt = cfg.get("ckpt")
        if ckpt and not _is_lightning_checkpoint(ckpt):  # an HF dir, .gguf, alias or hub id replaces model.policy.name
            cfg["model.policy.name"], cfg["model.policy.gguf_file"] = ckpt, None
            cfg["model.policy.config"] = None  # the built-in's shape: the saved config.json has it
            cfg["model.policy.lora"] = None  # a saved hf_model has the adapters merged
        cfg["model.policy.kl_to_ref"] = False  # no frozen copy of the policy just to evaluate
        cfg["trainer.logger"], cfg["trainer.callbacks"] = None, None  # no Trainer is built
        self.name_component_errors()

    def instantiate_classes(self) -> None:
        """The model and the data module only (``LightningCLI`` would also build a Trainer)."""
        try:
            self.config_init = self.parser.instantiate_classes(self.config)
        except Exception as exc:
            self.raise_one_line(exc)
        self.model = self._get(self.config_init, "model")
        self.datamodule = self._get(self.config_init, "data")
        self.trainer = None


def _is_lightning_checkpoint(path: str) -> bool:
    return path.endswith(".ckpt") or (Path(path).is_file() and not path.endswith(".gguf"))


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in ``argv`` (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def run_config(ckpt: str) -> Path | None:
    """The file holding the config of the run that wrote ``ckpt`` (``lit_gspo.lightning.run_dir.config_for``), or None."""
    found = run_dir.config_for(ckpt)
    return found.path if found else None


#: the settings that decide what a score means: which prompts are held out, how completions are scored
SCORE_KEYS = ("seed_everything", "model.rewards", "model.reward_weights", "model.environment", "data")


def load(argv: list[str]) -> EvalCLI:
    """Parse ``argv`` (fit's arguments plus the evaluation's), build the model and data module, load ``--ckpt``.

    The config is the one saved with the checkpoint (``lit_gspo.lightning.run_dir.config_for``) unless ``--config`` is given;
    settings given as options override it and are listed. A ``--config`` whose seed, rewards or data differ from the
    run's is refused (the score would be another run's: other held-out prompts or rewards), unless those settings
    are also given as options."""
    argv = list(argv)
    ckpt, given = _option(argv, "--ckpt"), _option(argv, "--config")
    if ckpt and ckpt.endswith(".ckpt") and not Path(ckpt).exists():
        raise SettingsError(
            f"--ckpt {ckpt}: no such file (a run's checkpoints are <run>/checkpoints/*.ckpt; its "
            "exported model is <run>/hf_model)"
        )
    found = run_dir.config_for(ckpt) if ckpt else None
    if found is None and given is None:
        _check_named_without_run(argv, ckpt)
    if found is not None and given is None:
        print(f"eval: reading the run's config: {found.origin}; --config to use another", flush=True)
        argv = ["--config", str(found.path) if found.path else found.text] + argv
    with warnings.catch_warnings():
        # `lit-gspo eval` consumed sys.argv and hands the rest over as `args`: no mistake here
        warnings.filterwarnings("ignore", message=CLI_ARGS_WARNING)
        cli = EvalCLI(
            _module_class(),
            _datamodule_class(),
            seed_everything_default=0,
            trainer_defaults=TRAINER_DEFAULTS,
            args=argv,
            run=False,
            save_config_callback=None,
            parser_kwargs={"prog": "lit-gspo eval", "description": DESCRIPTION},
        )
    if found is not None:
        _check_against_run(cli, found, argv, given)
    cfg = cli.config
    if cfg.get("ckpt") and _is_lightning_checkpoint(cfg.ckpt):
        load_checkpoint_policy(cli.model.policy, cfg.ckpt)
    device = torch.device(cfg.get("device") or _device_of(cfg.get("trainer.accelerator")))
    cli.model.policy.to(device)
    _cast(cli.model.policy, cfg.get("trainer.precision"))
    return cli


#: what a model without a run's saved settings is scored with: each group needs one of its options on the command line
WITHOUT_RUN = {
    "the prompts": ("data", "data.train_source", "data.val_source"),
    "the rewards": ("model.rewards", "model.environment"),
}


def _check_named_without_run(argv: list[str], ckpt: str | None) -> None:
    """A model that no run saved its settings with (an ``hf_model/`` written from Python, a hub id, a ``.gguf``) is
    scored only with the prompts and rewards the command line names (or ``--config``): the defaults (the arithmetic
    task, ``ExactMatch``) would score a model trained on anything else as 0, silently."""
    options = {a[2:].split("=", 1)[0].removesuffix("+") for a in argv if a.startswith("--")}
    missing = [what for what, names in WITHOUT_RUN.items() if not options & set(names)]
    if not missing:
        return
    source = f"--ckpt {ckpt}" if ckpt else "model.policy.name"
    raise SettingsError(
        f"{source} has no saved run settings (no lit_gspo_config.yaml beside it, no run_config.yaml in its run), so "
        f"{' and '.join(missing)} to score it with are unknown: give --config <the fit's config>, or "
        + " and ".join(
            {
                "the prompts": "--data.train_source TASK_OR_FILE (or --data.val_source FILE)",
                "the rewards": "--model.rewards '[REWARD, ...]' (e.g. '[lit_gspo.rl.rewards.ExactMatch]')",
            }[m]
            for m in missing
        )
    )


def _check_against_run(cli: EvalCLI, found: run_dir.FoundConfig, argv: list[str], given: str | None) -> None:
    """List the scoring settings that differ from the run's; refuse those that come from a ``--config`` file."""
    current = run_dir.load_yaml(run_dir.dump(cli.parser, cli.config))
    diffs = {
        k: v
        for k, v in run_dir.differences(run_dir.load_yaml(found.text), current, ignored=()).items()
        if any(k == p or k.startswith(p + ".") for p in SCORE_KEYS)
    }
    options = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    named = {
        k: v for k, v in diffs.items() if any(k == o or k.startswith(o + ".") or o.startswith(k + ".") for o in options)
    }
    unnamed = {k: v for k, v in diffs.items() if k not in named}
    if unnamed:
        raise SettingsError(
            f"--config {given} differs from the config of the run that wrote {cli.config.get('ckpt')} ({found.origin}) "
            f"in {run_dir.describe(unnamed)}: the score would not be the run's (other held-out prompts, rewards or "
            "seed). Leave out --config to score with the run's config, or give these settings as options "
            "(e.g. --seed_everything N) to score with them knowingly"
        )
    if named:
        print(f"eval: the run's settings overridden by options: {run_dir.describe(named)}", flush=True)


def _module_class():
    from lit_gspo.lightning.module import RLModule

    return RLModule


def _datamodule_class():
    from lit_gspo.lightning.datamodule import PromptDataModule

    return PromptDataModule


def _device_of(accelerator) -> str:
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu" if name == "auto" else name


def _cast(policy, precision) -> None:
    """``*-true`` precisions cast the weights (``*-mixed`` autocasts around sampling: ``_precision_context``)."""
    text = str(precision or "")
    if text in ("bf16-true", "bf16"):
        policy.to(torch.bfloat16)
    elif text in ("16-true", "16"):
        policy.to(torch.float16)


def _precision_context(precision, device: torch.device):
    text = str(precision or "")
    if text.endswith("-mixed"):
        return torch.autocast(device.type, dtype=torch.bfloat16 if text.startswith("bf16") else torch.float16)
    return contextlib.nullcontext()


def default_output(cfg) -> Path:
    """``<checkpoint>.eval.json`` next to a local checkpoint or model dir; else ``<model name>.eval.json`` here."""
    source = cfg.get("ckpt") or cfg.get("model.policy.name")
    path = Path(source)
    if path.is_dir():
        return path.parent / f"{path.name}.eval.json"
    if path.is_file():
        return path.with_suffix(".eval.json")
    return Path(re.sub(r"[^\w.-]+", "_", str(source)) + ".eval.json")


def sampled_settings(cfg, module, dm) -> dict:
    """``evaluate``'s sampling arguments: each one given as an option, else the run's sampled validation's
    (``model.validation``: n, temperature, pass@k's k and threshold, ``data.val_batch_size`` prompts a call), and its
    processes' seeded streams, so that the evaluation of a checkpoint reproduces the ``val/reward`` (mean@n) and
    ``val/pass@k`` its run logged at that step. A run that validates greedily: n = ``generation.num_generations`` at the
    generation's temperature, ``data.prompts_per_step`` prompts a call."""
    validation = module.validation
    samples = (
        cfg.samples
        if cfg.samples is not None
        else validation.num_generations or module.collector.generation.num_generations
    )
    as_validation = validation.num_generations and samples == validation.num_generations
    return {
        "samples": samples,
        "ks": cfg.k if cfg.k is not None else validation.pass_ks() if as_validation else None,
        "temperature": cfg.temperature if cfg.temperature is not None else validation.temperature,
        "threshold": cfg.threshold if cfg.threshold is not None else validation.pass_threshold,
        "sample_batch_size": cfg.sample_batch_size
        or (dm.val_batch_size if validation.num_generations else dm.prompts_per_step),
        "seed": [stream_seed(module.seed, rank=r, stream=VALIDATION_STREAM) for r in range(world_size(cfg))],
    }


def world_size(cfg) -> int:
    """``--world_size``; else the number of processes the run of ``--ckpt`` ran on (``run_dir.world_size_of``), 1 for
    a model of no run."""
    given = cfg.get("world_size")
    if given is not None and given < 1:
        raise SettingsError(f"--world_size {given}: the processes to sample as must be >= 1")
    return given or (cfg.get("ckpt") and run_dir.world_size_of(cfg.ckpt)) or 1


def run(cli: EvalCLI) -> dict:
    """Evaluate as configured; print the table and examples, write the JSON; returns what was written."""
    cfg, module, dm = cli.config, cli.model, cli.datamodule
    dm.setup()
    rows = dm.val_rows if cfg.split == "validation" else dm.train_rows
    rows = rows[: cfg.limit] if cfg.limit is not None else rows
    if not rows:
        raise ValueError(f"the {cfg.split} split of {dm.train_source!r} has no rows to evaluate")
    module.collector.rewards.check(list(rows[0]))  # a reward no column can feed fails now, naming its parameters
    sampled = sampled_settings(cfg, module, dm)
    policy = module.policy
    device = next(policy.parameters()).device
    user_errors.mark_started()  # settings, data and rewards checked: an error from here on is reported with its traceback
    start = time.perf_counter()
    with _precision_context(cfg.get("trainer.precision"), device):
        result = evaluate(
            policy,
            module.collector,
            rows,
            greedy=cfg.greedy,
            greedy_batch_size=cfg.greedy_batch_size or dm.val_batch_size,
            world_size=len(sampled["seed"]),
            **sampled,
        )
    seconds = time.perf_counter() - start
    source = cfg.get("ckpt") or cfg.get("model.policy.name")
    data = (dm.val_source or dm.train_source) if cfg.split == "validation" else dm.train_source
    header = {
        "model": source,
        "split": cfg.split,
        "data": data,
        "rewards": list(module.collector.rewards.names),
        "environment": repr(module.collector.environment),
        "engine": repr(module.collector.engine),
        "precision": str(cfg.get("trainer.precision")),
        "device": str(device),
        "seed": module.seed,
        "world_size": len(sampled["seed"]),
        "sample_seed": sampled["seed"],
        "seconds": seconds,
    }
    result = {**header, **result}
    processes = f", sampled as {len(sampled['seed'])} processes" if len(sampled["seed"]) > 1 else ""
    print(f"eval: {source} on {len(rows)} {cfg.split} prompts of {data}{processes} ({seconds:.1f} s)")
    print(format_table(result))
    for item in result["per_prompt"][: cfg.show if cfg.greedy else 0]:
        print(f"    {_short(item['prompt'])!r} -> {item['greedy_completion']!r} (reward {item['greedy_reward']:.3g})")
    output = Path(cfg.output) if cfg.output else default_output(cfg)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1, default=str))
    print(f"eval: wrote {output}")
    result["output"] = str(output)
    return result


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return text if len(text) <= 80 else text[:77] + "..."


def main(argv: list[str]) -> dict:
    """``lit-gspo eval ARGS``."""
    return run(load(argv))
