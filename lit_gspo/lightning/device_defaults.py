"""What depends on the device, which a module learns only when a Trainer sets it up: the default engine
(StaticCacheSampler on CUDA, HFGenerate elsewhere; an engine given is kept), deterministic CPU kernels, and a warning
when bf16 is emulated on this CPU (once: a validate and a fit set up the same module)."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn

from lit_gspo.rl.engines import default_engine
from lit_gspo.runtime.hardware import SlowPrecisionWarning, bf16_on_cpu_warning, deterministic_on_cpu


class DeviceDefaults:
    def __init__(self, engine_given: bool):
        self.engine = None if engine_given else default_engine("cpu")  # resolved for the device in apply
        self.warned = False

    def apply(self, module) -> None:
        device = module.trainer.strategy.root_device
        if self.engine is not None and module.collector.engine is self.engine:  # not replaced since
            engine = default_engine(device, sharded=module.synced_gpus())
            if type(engine) is not type(self.engine):
                module.collector.engine = self.engine = engine
        deterministic_on_cpu(device.type)  # before the warm start's first backward
        advice = bf16_on_cpu_warning(module.trainer.precision, device.type)
        if advice and not self.warned:
            self.warned = True
            rank_zero_warn(advice, category=SlowPrecisionWarning)
