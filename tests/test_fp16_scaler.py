"""fp16 with Lightning's GradScaler (``16-mixed``): the learner clips the unscaled gradients, and an overflow step is the
scaler's to skip (it lowers its scale) rather than a non-finite step that stops the run. CUDA is where fp16 runs; here a
CPU GradScaler drives the same code through Lightning's ``MixedPrecision`` plugin."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lit_gspo import CharAccuracy, Generation, Policy, PromptDataModule, RLModule, Update


def fit(tmp_path, init_scale: float, steps: int = 3):
    L.seed_everything(0, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    module = RLModule(
        policy=Policy("tiny-llama", config={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}),
        rewards=[CharAccuracy()],
        generation=Generation(num_generations=8, max_new_tokens=6),
        update=Update(num_minibatches=2, max_grad_norm=1.0),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    data = PromptDataModule(
        train_source="reversal",
        task_kwargs={"min_length": 3, "max_length": 3},
        num_train=32,
        num_val=4,
        prompts_per_step=8,
        seed=0,
    )
    seen = []

    class Norms(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,  # RL steps
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        default_root_dir=str(tmp_path),
        callbacks=[Norms()],
    )
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer.fit(module, datamodule=data)
    changed = any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    return scaler, seen, changed


def test_the_gradient_norm_is_the_unscaled_one(tmp_path):
    """Clipped before unscaling, the norm would carry the scale (2**12 here): the logged norm is the true one."""
    small, seen_small, _ = fit(tmp_path / "a", init_scale=2.0**4)
    large, seen_large, _ = fit(tmp_path / "b", init_scale=2.0**12)
    norms_small = [s["train/grad_norm"] for s in seen_small]
    norms_large = [s["train/grad_norm"] for s in seen_large]
    assert all(n > 0 for n in norms_small) and all(n < 50 for n in norms_small + norms_large), (
        norms_small,
        norms_large,
    )
    assert norms_large == pytest.approx(norms_small, rel=0.05)


def test_an_fp16_overflow_is_skipped_by_the_scaler_which_lowers_its_scale(tmp_path):
    """A scale too large overflows fp16: the scaler skips those steps and halves its scale each time, until steps go
    through; the run neither stops (max_nonfinite_steps) nor leaves the scale stuck."""
    scaler, seen, changed = fit(tmp_path, init_scale=2.0**24, steps=10)
    assert scaler.get_scale() < 2.0**24
    assert seen[0]["train/nonfinite_steps"] > 0  # the first steps overflowed
    assert changed  # later ones went through
