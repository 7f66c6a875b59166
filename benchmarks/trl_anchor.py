"""The issue's anchor, re-run here: TRL GRPOTrainer with GSPO settings trains SmolLM2-135M-Instruct on addition.

Settings as stated for the anchor: importance_sampling_level="sequence", ε 3e-4/4e-4, β 0, 16 completions
per update (2 prompts × G=8), steps_per_generation 2, ≤ 48 new tokens, lr 5e-6 constant, 60 updates;
prompts "What is A + B? Answer with just the number.", reward = last number equals the answer. The
trained model is saved as an HF dir; score it with scripts/eval_arithmetic.py (same held-out sets
as lit_gspo's runs).

    python benchmarks/trl_anchor.py --precision fp32 --threads 2
    python scripts/eval_arithmetic.py runs/trl_anchor/hf_model --n 128
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import ROOT, model_dir, trl_trainer  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "runs" / "trl_anchor")
    p.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "smollm2-135m-instruct-hf")
    args = p.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(args.threads)
    log: list[dict] = []

    class Log(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            log.append({"update": state.global_step, "seconds": time.perf_counter() - self.start})

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and log:
                log[-1].update({k: logs[k] for k in ("reward", "completions/mean_length") if k in logs})

    trainer = trl_trainer(
        model_dir(args.model_dir),
        args.output,
        updates=args.updates,
        precision=args.precision,
        checkpointing=True,
        num_prompts=4000,
        callbacks=[Log()],
        seed=args.seed,
    )
    tokenizer = trainer.processing_class
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.model.save_pretrained(args.output / "hf_model")
    tokenizer.save_pretrained(args.output / "hf_model")
    with open(args.output / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in log for k in r}))
        writer.writeheader()
        writer.writerows(log)
    print(
        f"TRL {args.updates} updates in {wall:.0f} s ({wall / args.updates:.1f} s/update), {args.precision}, "
        f"{args.threads} thread(s); model: {args.output / 'hf_model'}"
    )


if __name__ == "__main__":
    main()
