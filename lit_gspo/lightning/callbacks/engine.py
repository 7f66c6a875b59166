"""The rollout engine's resources end with the fit that used them."""

from __future__ import annotations

from lightning.pytorch import Callback


class CloseEngine(Callback):
    """At the end of a fit, finished or failed, the engine frees what it holds (``RolloutEngine.close``: a vLLM and
    its KV cache). Several fits in one process (``lit-gspo ablate``'s arms, a notebook) then each build their own:
    vLLM allows one engine per process. Validation before the fit keeps it (the fit samples with it next); a
    validation after a fit builds it again."""

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            pl_module.collector.engine.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        pl_module.collector.engine.close()
