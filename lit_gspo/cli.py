"""The ``lit-gspo`` entry point: LightningCLI's ``fit`` (``lit_gspo.rlcli``), ``eval``, ``ablate`` and ``compare``.

``lit-gspo fit --config configs/quickstart.yaml``; ``lit-gspo eval --ckpt runs/quickstart/hf_model``;
``lit-gspo ablate --config configs/ablate/<name>.yaml``; ``lit-gspo compare --rollout <run>/rollouts/step_K.pt``.
Dependencies point one way: cli → ablate → rlcli, cli → eval_cli → rlcli, cli → compare → learner, and cli → rlcli.
"""

from __future__ import annotations

import sys

from lit_gspo import ablate, compare, eval_cli, user_errors
from lit_gspo.rlcli import RLCLI, cli_main  # noqa: F401  (``lit_gspo.cli.cli_main`` is what tests and scripts import)

# Subcommands run here, before LightningCLI: name → (its parser, its main).
COMMANDS = {"eval": (eval_cli.make_parser, eval_cli.main), "ablate": (ablate.make_parser, ablate.main),
            "compare": (compare.make_parser, compare.main)}

# Lightning's predict: RLModule has nothing to predict (lit-gspo eval writes completions)
NOT_COMMANDS = {"predict"}


def main(argv: list[str] | None = None) -> None:
    """``lit-gspo ...``: a user's mistake (a bad setting, a missing file, an unknown option) is one ``error:`` line
    and exit code 2, a bug keeps its traceback; ``--debug`` or ``LIT_GSPO_DEBUG=1`` shows every traceback
    (``lit_gspo.user_errors``)."""
    args = user_errors.strip_debug(sys.argv[1:] if argv is None else list(argv))
    return user_errors.run_reporting(_main, args, argv is None)


def _main(args: list[str], from_sys_argv: bool) -> None:
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]][1](args[1:])
        return
    if args and args[0] in NOT_COMMANDS:
        print(f"lit-gspo {args[0]}: not a command. `lit-gspo validate --config <run config> --ckpt_path <ckpt or hf_model>` "
              "gives val/reward; `lit-gspo eval --ckpt <run>/hf_model` writes greedy completions, accuracy and pass@k "
              "(lit-gspo eval --help)", file=sys.stderr)
        sys.exit(2)
    if args and args[0] in ("validate", "test"):
        args = with_run_config(args)
    if from_sys_argv:  # LightningCLI reads sys.argv itself (without --debug); its --help lists COMMANDS beside fit
        sys.argv = sys.argv[:1] + args
    cli_main(None if from_sys_argv else args,
             other_subcommands={name: make_parser() for name, (make_parser, _) in COMMANDS.items()})


def with_run_config(args: list[str]) -> list[str]:
    """``lit-gspo validate|test --ckpt_path X`` without ``--config``: the config of the run that wrote X (stored in the
    checkpoint, beside the export, or the run's ``run_config.yaml``: ``lit_gspo.run_dir.config_for``), as eval reads it."""
    from lit_gspo import run_dir

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
