"""The ``lit-gspo`` entry point: LightningCLI's ``fit`` (``lit_gspo.rlcli``), ``eval``, ``ablate`` and ``compare``.

``lit-gspo fit --config configs/quickstart.yaml``; ``lit-gspo eval --ckpt runs/quickstart/hf_model``;
``lit-gspo ablate --config configs/ablate/<name>.yaml``; ``lit-gspo compare --rollout <run>/rollouts/step_K.pt``.
Dependencies point one way: cli → ablate → rlcli, cli → eval_cli → rlcli, cli → compare → learner, and cli → rlcli.
"""

from __future__ import annotations

import sys

from lit_gspo import ablate, compare, eval_cli
from lit_gspo.rlcli import RLCLI, cli_main  # noqa: F401  (``lit_gspo.cli.cli_main`` is what tests and scripts import)

# Subcommands run here, before LightningCLI: name → (its parser, its main).
COMMANDS = {"eval": (eval_cli.make_parser, eval_cli.main), "ablate": (ablate.make_parser, ablate.main),
            "compare": (compare.make_parser, compare.main)}

# Lightning's predict: RLModule has nothing to predict (lit-gspo eval writes completions)
NOT_COMMANDS = {"predict"}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]][1](args[1:])
        return
    if args and args[0] in NOT_COMMANDS:
        print(f"lit-gspo {args[0]}: not a command. `lit-gspo validate --config <run config> --ckpt_path <ckpt or hf_model>` "
              "gives val/reward; `lit-gspo eval --ckpt <run>/hf_model` writes greedy completions, accuracy and pass@k "
              "(lit-gspo eval --help)", file=sys.stderr)
        sys.exit(2)
    # None: LightningCLI reads sys.argv itself; its --help lists COMMANDS beside fit
    cli_main(argv, other_subcommands={name: make_parser() for name, (make_parser, _) in COMMANDS.items()})


if __name__ == "__main__":
    main()
