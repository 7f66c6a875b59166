"""The ``lit-gspo`` entry point: LightningCLI's ``fit``/``validate``/``test`` (``lit_gspo.lightning.cli``), and
``eval``, ``ablate``, ``compare`` (``lit_gspo.tools.<name>``).

``lit-gspo fit --config configs/quickstart.yaml``; ``lit-gspo eval --ckpt runs/quickstart/hf_model``;
``lit-gspo ablate --config configs/ablate/<name>.yaml``; ``lit-gspo compare --rollout <run>/rollouts/step_K.pt``.
A subcommand imports only its own module (``lit-gspo compare --help`` loads no Lightning); ``fit``'s ``--help``
lists the others beside it, so it builds their parsers.
"""

from __future__ import annotations

import importlib
import sys

from lit_gspo.runtime import user_errors
from lit_gspo.runtime.installed import check_installed
from lit_gspo.runtime.own_context import run_in_own_context

# Subcommands run here, before LightningCLI: name → the module with its ``make_parser`` and ``main``.
COMMANDS = {"eval": "lit_gspo.tools.eval", "ablate": "lit_gspo.tools.ablate", "compare": "lit_gspo.tools.compare"}


def command(name: str):
    """The module of subcommand ``name`` (imported now)."""
    return importlib.import_module(COMMANDS[name])


def cli_main(*args, **kwargs):
    """``lit_gspo.lightning.cli.cli_main`` (imported on call: LightningCLI for fit, validate and test)."""
    from lit_gspo.lightning.cli import cli_main as lightning_cli_main

    return lightning_cli_main(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """``lit-gspo ...``: a user's mistake (a bad setting, a missing file, an unknown option) is one ``error:`` line
    and exit code 2, a bug keeps its traceback; ``--debug`` or ``LIT_GSPO_DEBUG=1`` shows every traceback
    (``lit_gspo.runtime.user_errors``). Called in a process (a notebook, a test), it leaves nothing of the run in
    the caller's context variables (``lit_gspo.runtime.own_context``)."""
    args = user_errors.strip_debug(sys.argv[1:] if argv is None else list(argv))
    return run_in_own_context(user_errors.run_reporting, _main, args, argv is None)


def _main(args: list[str], from_sys_argv: bool) -> None:
    check_installed()  # a package outside lit_gspo's requirements: one error here, not a failure far from its cause
    if args and args[0] in COMMANDS:
        command(args[0]).main(args[1:])
        return
    from lit_gspo.lightning.run_dir import SCORING  # imports Lightning, which every subcommand from here on runs

    if args and args[0] in SCORING:
        args = with_run_config(args)
    if from_sys_argv:  # LightningCLI reads sys.argv itself (without --debug); its --help lists COMMANDS beside fit
        sys.argv = sys.argv[:1] + args
    cli_main(
        None if from_sys_argv else args, other_subcommands={name: command(name).make_parser() for name in COMMANDS}
    )


def with_run_config(args: list[str]) -> list[str]:
    """``lit-gspo validate|test|predict --ckpt_path X`` without ``--config``: the config of the run that wrote X (stored in the
    checkpoint, beside the export, or the run's ``run_config.yaml``: ``lit_gspo.lightning.run_dir.config_for``), as eval reads it."""
    from lit_gspo.lightning import run_dir

    eval_cli = command("eval")
    ckpt = eval_cli._option(args, "--ckpt_path")
    if ckpt is None or eval_cli._option(args, "--config") is not None:
        return args
    found = run_dir.config_for(ckpt)
    if found is None:
        return args
    print(f"{args[0]}: reading the run's config: {found.origin}; --config to use another", flush=True)
    return [args[0], "--config", str(found.path) if found.path else found.text, *args[1:]]


if __name__ == "__main__":
    main()
