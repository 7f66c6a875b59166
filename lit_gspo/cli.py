"""The ``lit-gspo`` entry point: LightningCLI's fit/validate/test/predict (``lit_gspo.rlcli``) and ``ablate``.

``lit-gspo fit --config configs/quickstart.yaml``; ``lit-gspo ablate --config configs/ablate/<name>.yaml``.
Dependencies point one way: cli → ablate → rlcli, and cli → rlcli.
"""

from __future__ import annotations

import sys

from lit_gspo import ablate
from lit_gspo.rlcli import RLCLI, cli_main  # noqa: F401  (``lit_gspo.cli.cli_main`` is what tests and scripts import)

# Subcommands run here, before LightningCLI: name → (its parser, its main).
COMMANDS = {"ablate": (ablate.make_parser, ablate.main)}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]][1](args[1:])
        return
    # None: LightningCLI reads sys.argv itself; its --help lists COMMANDS beside fit/validate/test/predict
    cli_main(argv, other_subcommands={name: make_parser() for name, (make_parser, _) in COMMANDS.items()})


if __name__ == "__main__":
    main()
