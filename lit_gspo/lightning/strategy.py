"""Lightning strategies lit_gspo runs under: DDP, FSDP2 (``ModelParallelStrategy``, its checkpoints swapped in
whole); every other refused at start (:data:`STRATEGIES`, every name of Lightning's registry and every strategy class,
classified once); a strategy given by class path built.

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

import lightning.pytorch.strategies as lightning_strategies
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry

from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED, Flag
from lit_gspo.runtime.files import fsync_dir

FSDP1_NOTE = (
    "Lightning's FSDP1 with manual optimisation is "
    "broken (Lightning #19626, #19685). Use FSDP2 instead: --trainer.strategy "
    "lightning.pytorch.strategies.ModelParallelStrategy --trainer.strategy.data_parallel_size <devices> "
    "--trainer.strategy.tensor_parallel_size 1 (see configs/scale/fsdp2_cpu.yaml and fsdp2_cuda.yaml)."
)


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


_UNUSED = ("", "_find_unused_parameters_false", "_find_unused_parameters_true")
_DDP = "one process per device, started by lit-gspo fit, or by Lightning for a script run with python or torchrun"
_STARTED = (
    "the processes it starts train copies of the module; the one you hold gets back the weights, not the run's state "
    f"(RL step, optimiser, random streams, warm start), so a second fit or a checkpoint from it starts over: use ddp, {_DDP}"
)
_DEEPSPEED = (
    "DeepSpeed takes over the optimiser step and gradient accumulation, which RLModule's hand-made optimiser steps (K "
    "epochs x M minibatches per RL step) bypass: shard with FSDP2 (lightning.pytorch.strategies.ModelParallelStrategy)"
)
_XLA = "lit_gspo runs on CPUs and CUDA GPUs (--trainer.accelerator cpu or cuda)"

#: Lightning's strategy names (its registry, and ``auto``) and its strategy classes → how an RL fit treats them
STRATEGIES: dict[str, Flag] = {
    "auto": Flag(HONOURED, "one device: SingleDeviceStrategy; several: ddp"),
    **{f"ddp{unused}": Flag(HONOURED, _DDP) for unused in _UNUSED},
    **{
        f"ddp_{start}{unused}": Flag(REFUSED, _STARTED) for start in ("spawn", "fork", "notebook") for unused in _UNUSED
    },
    **{
        f"deepspeed{stage}": Flag(REFUSED, _DEEPSPEED)
        for stage in (
            "",
            "_stage_1",
            "_stage_2",
            "_stage_2_offload",
            "_stage_3",
            "_stage_3_offload",
            "_stage_3_offload_nvme",
        )  # fmt: skip
    },
    "fsdp": Flag(REFUSED, FSDP1_NOTE),
    "fsdp_cpu_offload": Flag(REFUSED, FSDP1_NOTE),
    "single_device": Flag(HONOURED, "one device"),
    **{name: Flag(REFUSED, _XLA) for name in ("single_tpu", "single_xla", "xla", "xla_debug")},
    "Strategy": Flag(HONOURED, "a strategy of your own (the base of every strategy)"),
    "ParallelStrategy": Flag(HONOURED, "the base of the multi-process strategies"),
    "SingleDeviceStrategy": Flag(HONOURED, "one device"),
    "DDPStrategy": Flag(HONOURED, f"{_DDP}; started by spawn or fork it is refused"),
    "ModelParallelStrategy": Flag(HONOURED, "FSDP2 over data-parallel ranks, its checkpoints swapped in whole"),
    "DeepSpeedStrategy": Flag(REFUSED, _DEEPSPEED),
    "FSDPStrategy": Flag(REFUSED, FSDP1_NOTE),
}


def refused_classes() -> dict[type, str]:
    """The strategy classes that only refused names build (DDPStrategy aside: refused by how it starts) → their
    shortest name (``xla``, not ``xla_debug``)."""
    by_class: dict[type, list[str]] = {}
    for name in StrategyRegistry.available_strategies():
        by_class.setdefault(StrategyRegistry[name]["strategy"], []).append(name)
    return {
        cls: min(names, key=len)
        for cls, names in by_class.items()
        if cls is not DDPStrategy and all(STRATEGIES[name].kind == REFUSED for name in names)
    }


def check_strategy(strategy: Any) -> None:
    """Raise :class:`SettingsError` (``lit-gspo``: one line) for a strategy an RL fit refuses (:data:`STRATEGIES`), saying
    what to use: ``strategy`` a name (``ddp_spawn``), a class path, a class, or an instance (a ``DDPStrategy`` started
    by fork is known by its launcher; one started by spawn fails to pickle the module before any check can run)."""
    if strategy is None:
        return
    if isinstance(strategy, str):
        name = strategy.rsplit(".", 1)[-1]  # a class path: its class's name
    elif isinstance(strategy, type) or isinstance(strategy, lightning_strategies.Strategy):
        cls, refused = (strategy if isinstance(strategy, type) else type(strategy)), refused_classes()
        names = [refused[klass] for klass in cls.__mro__ if klass in refused]
        launcher = getattr(strategy, "launcher", None) if isinstance(strategy, DDPStrategy) else None
        name = names[0] if names else "ddp_fork" if getattr(launcher, "is_interactive_compatible", False) else ""
    else:
        return
    flag = STRATEGIES.get(name)
    if flag is not None and flag.kind == REFUSED:
        raise flag.refusal(f"strategy {name}")


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
