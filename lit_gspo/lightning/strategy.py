"""Lightning strategies lit_gspo runs under: DDP, FSDP2 (``ModelParallelStrategy``, its checkpoints swapped in
whole); FSDP1 refused; a strategy given by class path built.

FSDP1 (``FSDPStrategy``) is refused: manual optimisation with it is broken in Lightning (#19626,
#19685: manual optimisation calls backward inside the wrapped module's "forward" — ``training_step``
— which FSDP1's wrapper does not support, and Lightning has no workaround like the one it uses for
DDP), and it refuses CPU.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from lit_gspo.runtime.files import fsync_dir

FSDP1_MESSAGE = (
    "FSDPStrategy (FSDP1) is not supported by lit_gspo: Lightning's FSDP1 with manual optimisation is "
    "broken (Lightning #19626, #19685). Use FSDP2 instead: --trainer.strategy "
    "lightning.pytorch.strategies.ModelParallelStrategy --trainer.strategy.data_parallel_size <devices> "
    "--trainer.strategy.tensor_parallel_size 1 (see configs/scale/fsdp2_cpu.yaml and fsdp2_cuda.yaml)."
)


def is_fsdp1_strategy(strategy: Any) -> bool:
    """True for ``FSDPStrategy`` instances/classes or the registry names that build one (``fsdp``, ``fsdp_...``)."""
    if isinstance(strategy, str):
        return strategy == "fsdp" or strategy.startswith("fsdp_") or strategy.endswith("FSDPStrategy")
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:  # pragma: no cover
        return False
    return isinstance(strategy, FSDPStrategy) or (isinstance(strategy, type) and issubclass(strategy, FSDPStrategy))


def strategy_from_path(strategy: Any) -> Any:
    """A strategy given as a dotted class path string (``--trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy``,
    which jsonargparse leaves a string when no init_args follow) built with its defaults; anything else as it is.

    Lightning takes a string for a registry name only ("invalid strategy name: lightning.pytorch.strategies...").
    """
    if not isinstance(strategy, str) or "." not in strategy:
        return strategy
    from lightning.pytorch.strategies import Strategy

    from lit_gspo.runtime.imports import import_path

    try:
        cls = import_path(strategy)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--trainer.strategy {strategy}: no such class ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"--trainer.strategy {strategy} is not a Lightning Strategy class")
    return cls()


def check_strategy(strategy: Any) -> None:
    if is_fsdp1_strategy(strategy):
        raise ValueError(FSDP1_MESSAGE)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints (directories) are swapped in whole. lit_gspo shards over
    data-parallel ranks only: give ``data_parallel_size`` = every process and ``tensor_parallel_size=1`` (the CLI fills
    them in for a ``ModelParallelStrategy`` given without sizes: ``lit_gspo.lightning.cli.atomic_strategy``).

    Every rank writes its shard into ``.<name>.tmp``; rank 0 then renames the old checkpoint away,
    the new one into place, and deletes the old one. A crash before the swap leaves the previous
    checkpoint untouched; in the instant between the two renames only ``.<name>.old`` exists, which
    :meth:`load_checkpoint` falls back to.
    """

    def __init__(self, *args, save_distributed_checkpoint: bool = True, **kwargs) -> None:
        super().__init__(*args, save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.distributed_checkpoint = save_distributed_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self.distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        tmp, old = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()
        if self.global_rank == 0:
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            fsync_dir(path.parent)
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        old = path.parent / f".{path.name}.old"
        if not path.exists() and old.exists():
            checkpoint_path = old
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
