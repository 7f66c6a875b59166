"""A short ``fit`` run for the distributed tests, launched as a subprocess (Lightning re-runs it per rank).

    python tests/dist_run.py [--ckpt_path last] [--crash_at_save N] OUT_DIR -- <lit-gspo CLI args>

Sampling is made independent of how prompts are split over ranks: every prompt's G completions are
drawn from a generator seeded by (prompt tokens, step), inside ``torch.random.fork_rng`` so the global
RNG stream is untouched. A single process with ``prompts_per_step = 2k`` and two ranks with ``k``
each then see the same global batch. Rank 0 writes ``OUT_DIR/result.pt``: the full policy weights
(gathered under FSDP2), the CSV metrics, and the optimiser state dtypes and bytes of rank 0.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class _Step:
    """The optimiser step at the start of the current batch (so a resumed run seeds like a continuous one)."""

    value = 0


def per_prompt_seeded_engine():
    """HFGenerate, but each prompt's completions come from a generator seeded by (prompt tokens, step)."""
    from lit_gspo.rl.engines import HFGenerate
    from lit_gspo.rl.rollout import concat_rollouts

    class PerPromptSeeded(HFGenerate):
        def sample(self, policy, prompt_ids, *, pad_id, greedy=False, **kwargs):
            if greedy:
                return super().sample(policy, prompt_ids, pad_id=pad_id, greedy=True, **kwargs)
            parts = []
            for ids in prompt_ids:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(zlib.crc32(str((list(ids), _Step.value)).encode()))
                    parts.append(super().sample(policy, [ids], pad_id=pad_id, **kwargs))
            return concat_rollouts(parts, pad_id)

    return PerPromptSeeded()


def crash_during_save(n: int, marker: Path) -> None:
    """Make the n-th checkpoint write stall half-way (after touching ``marker``) so the test can SIGKILL us."""
    from lit_gspo.lightning.checkpoint_io import AtomicCheckpointIO

    original = AtomicCheckpointIO._write
    count = {"n": 0}

    def _write(self, checkpoint, f):
        count["n"] += 1
        if count["n"] < n:
            return original(self, checkpoint, f)
        import io

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        marker.write_text(str(count["n"]))
        time.sleep(600)

    AtomicCheckpointIO._write = _write


def count_syncs_hook(syncs: list):
    """DDP's allreduce of each gradient bucket, appending to ``syncs`` once per backward that reduces (its bucket 0)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        if bucket.index() == 0:
            syncs.append(1)
        return allreduce_hook(state, bucket)

    return hook


def count_syncs_callback(syncs: list):
    """A callback registering :func:`count_syncs_hook` on the DDP-wrapped module (Lightning registers comm hooks on CUDA
    only)."""
    from lightning.pytorch.callbacks import Callback

    class _CountSyncs(Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.model.register_comm_hook(None, count_syncs_hook(syncs))

    return _CountSyncs()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt_path", default=None)
    parser.add_argument("--crash_at_save", type=int, default=0)
    parser.add_argument("--count_syncs", action="store_true", help="count DDP's gradient reductions (result: syncs)")
    parser.add_argument("cli", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    out = Path(args.out)
    cli_args = [a for a in args.cli if a != "--"]

    if args.crash_at_save:
        crash_during_save(args.crash_at_save, out / "crashing")

    from lit_gspo.runtime.optim import optimizer_state_bytes, state_dtypes
    from lit_gspo.runtime.sharding import full_state_dict, is_sharded
    from lit_gspo.tools.main import cli_main

    cli = cli_main(cli_args, run=False)
    cli.model.collector.engine = per_prompt_seeded_engine()
    from lightning.pytorch.callbacks import Callback

    class TrackStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            _Step.value = pl_module.optimizer_steps  # optimiser steps taken (global_step counts RL steps)

    cli.trainer.callbacks.append(TrackStep())
    syncs: list = []
    if args.count_syncs:
        cli.trainer.callbacks.append(count_syncs_callback(syncs))
    refills: list = []  # the rows this rank's trainer drew as refills (dynamic sampling, an async pipeline's priming)
    draw = cli.model.refill_rows
    cli.model.refill_rows = lambda count, generator=None: refills.extend(draw(count, generator)) or refills[-count:]
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=args.ckpt_path)
    elapsed = time.perf_counter() - start
    model = cli.model
    weights = (
        full_state_dict(model.policy)
        if is_sharded(model.policy)
        else {k: v.detach().clone() for k, v in model.policy.state_dict().items()}
    )
    opt = cli.trainer.optimizers[0]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out / f"weights_rank{cli.trainer.global_rank}.pt")  # each rank's own copy
    torch.save(refills, out / f"refills_rank{cli.trainer.global_rank}.pt")
    if cli.trainer.is_global_zero:
        rows, by_file = [], {}
        root = Path(cli.trainer.default_root_dir)
        for f in sorted(root.glob("**/metrics.csv")):
            with open(f) as fh:
                by_file[str(f.relative_to(root))] = list(csv.DictReader(fh))
                rows += by_file[str(f.relative_to(root))]
        result = {
            "weights": weights,
            "metrics": rows,
            "metrics_by_file": by_file,
            "world_size": cli.trainer.world_size,
            "seconds": elapsed,
            "optimizer": type(opt).__name__,
            "state_dtypes": {k: sorted(str(d) for d in v) for k, v in state_dtypes(opt).items()},
            "state_bytes": optimizer_state_bytes(opt),
            "uint8_state_numel": sum(
                v.numel()
                for s in opt.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dtype == torch.uint8
            ),
            "param_numel": sum(p.numel() for p in model.policy.parameters()),
            "syncs": len(syncs),
        }
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "result.pt")
    if cli.trainer.world_size > 1:  # as `lit-gspo fit` does (run=False skips it): a live gloo group can abort the exit
        from lit_gspo.runtime.collectives import end_process_group

        end_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
