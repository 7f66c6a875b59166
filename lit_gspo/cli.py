"""The command line: ``lit-gspo fit --config configs/quickstart.yaml`` (LightningCLI) and ``lit-gspo ablate``."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger

# importing registers every built-in stage, so class names resolve: `--model.objective GSPO`, `--model.engine LeanSampler`
from lit_gspo import advantages, engines, envs  # noqa: F401
from lit_gspo.objectives import OBJECTIVES
from lit_gspo.data import PromptDataModule
from lit_gspo.module import RLModule

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,  # one CSV row per RL step
    "num_sanity_val_steps": 0,
    "enable_model_summary": False,
}


def objective_hint(message: str) -> str:
    """What to add to a parser error about ``model.objective``: the registered names (jsonargparse only
    says the value is not an import path)."""
    if 'key "model.objective"' not in message:
        return ""
    names = ", ".join(sorted(cls.__name__ for cls in OBJECTIVES.values()))
    return (f"\n  Known objectives: {names} (class names, e.g. `--model.objective GSPO`), or the dotted "
            "import path of your own Objective subclass (`--model.objective my_pkg.MyObjective`).")


class RLArgumentParser(LightningArgumentParser):
    """Parser errors about the objective list the objectives that exist."""

    def error(self, message: str, ex: Exception | None = None):
        return super().error(message + objective_hint(message), ex)


class RLCLI(LightningCLI):
    """LightningCLI with CSV metrics by default (``<default_root_dir>/**/metrics.csv``) and checkpoints.

    Checkpoints (``lit_gspo.checkpointing``): ``<default_root_dir>/checkpoints/last.ckpt`` every
    ``checkpoint_every_n_steps`` steps, written atomically; resume with ``--ckpt_path last``.
    ``FSDPStrategy`` (FSDP1) is refused with a pointer to ``ModelParallelStrategy`` (FSDP2).
    """

    def __init__(self, *args, parser_class: type[LightningArgumentParser] = RLArgumentParser, **kwargs) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--checkpoint_every_n_steps", type=int, default=50,
                            help="save <default_root_dir>/checkpoints/last.ckpt every n optimiser steps "
                                 "(with trainer.enable_checkpointing; 0 = at the end of each epoch)")

    def _instantiate_trainer(self, config, callbacks):
        from lit_gspo.checkpointing import configure_checkpointing

        if config.get("logger") in (None, True):
            config["logger"] = CSVLogger(save_dir=config.get("default_root_dir") or os.getcwd())
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        configure_checkpointing(config, callbacks, cfg.get("checkpoint_every_n_steps", 50))
        return super()._instantiate_trainer(config, callbacks)


def cli_main(args: list[str] | None = None, run: bool = True) -> RLCLI:
    return RLCLI(RLModule, PromptDataModule, seed_everything_default=0, trainer_defaults=TRAINER_DEFAULTS,
                 save_config_kwargs={"overwrite": True}, args=args, run=run)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "ablate":
        from lit_gspo.ablate import main as ablate_main

        ablate_main(args[1:])
        return
    cli_main(argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
