"""Several processes: ranks end with the process that launched them, and a timed-out collective says why."""

from __future__ import annotations

import sys

from lightning.pytorch import Callback

from lit_gspo.lightning.callbacks.signals import RunInterrupted
from lit_gspo.runtime.processes import end_with_parent


class EndWithLauncher(Callback):
    """Ranks other than 0 on each node end with the process that launched them (:func:`end_with_parent`): a rank
    stuck outside any collective never outlives a rank 0 that failed and exited."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.local_rank > 0:
            end_with_parent()


class ExplainCollectiveTimeout(Callback):
    """A collective that timed out is another rank stuck or dead: say so, and which setting bounds the wait."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if (
            trainer.world_size > 1
            and not isinstance(exception, RunInterrupted)
            and ("timed out" in str(exception).lower() or "timeout" in type(exception).__name__.lower())
        ):
            print(
                f"\n[rank {trainer.global_rank}] a collective timed out: another rank is stuck or died (in its "
                "reward, its data, ...). The limit is the strategy's timeout (Lightning's default 30 min), e.g. "
                "--trainer.strategy lightning.pytorch.strategies.DDPStrategy --trainer.strategy.timeout 0:05:00",
                file=sys.stderr,
                flush=True,
            )
