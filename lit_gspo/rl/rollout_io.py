"""Frozen rollouts on disk: ``<run>/rollouts/step_K.pt``, what ``lit-gspo compare`` replays through every objective.

``RLModule(rollout_dumps=RolloutDumps(every_n_steps=N))`` (``--model.generation.dump_every_n_steps N``) writes, at every RL step K that is a positive multiple of N, the
step's rollout after its advantages are computed and before its update:

    step_K.pt           {"format": 1, "step": K, "prompt_length": P, "tensors": {field: tensor},
                         "routing": [(N, P + T, k) per MoE layer] or None, "meta": {...}}
    step_K_policy/      the policy that sampled it (Hugging Face format), with ``rollout_dumps.with_policy``, and
                        ``optimizer.pt``, the optimiser's state then (one process, no LoRA, no critic)

``tensors`` holds every set tensor field of :class:`~lit_gspo.rl.rollout.RolloutBatch`: tokens, masks, rewards,
advantages, engine / old / reference log-probs, turn ids. ``old_logprobs`` are the trainer's log-probs of the
sampling policy (on-policy training never computes them; the writer runs one no-grad pass for the file).
``meta`` is what a replay needs to compute the same log-probs and minibatches: the sampling temperature, the
generation budget L, the group size, the ``model.update`` settings, the objective and optimiser of the run.

Only tensors and plain data: the file loads with ``torch.load(weights_only=True)``. It is written by
:func:`~lit_gspo.runtime.checkpoint_files.save_hashed` (temporary file, fsync, rename, sha256 beside it), and
read back through it, so a truncated or changed file is refused with a message, never half-read.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from lit_gspo.models.routing import RoutingRecord
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.runtime.checkpoint_files import load_verified, save_hashed

FORMAT = 1
OPTIMIZER_FILE = "optimizer.pt"


def rollout_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}.pt"


def policy_dir(path: str | Path) -> Path:
    """Where the policy that sampled the rollout file ``path`` is saved: ``step_K.pt`` → ``step_K_policy/``."""
    path = Path(path)
    return path.parent / f"{path.stem}_policy"


def save_rollout(path: str | Path, rollout: RolloutBatch, step: int, meta: dict | None = None) -> Path:
    """Write ``rollout`` (every tensor on CPU) and ``meta`` (plain data) to ``path`` atomically."""
    tensors = {
        f.name: getattr(rollout, f.name).detach().cpu()
        for f in fields(rollout)
        if isinstance(getattr(rollout, f.name), torch.Tensor)
    }
    routing = None if rollout.routing is None else [t.detach().cpu() for t in rollout.routing.indices]
    payload = {
        "format": FORMAT,
        "step": int(step),
        "prompt_length": int(rollout.prompt_length),
        "tensors": tensors,
        "routing": routing,
        "meta": dict(meta or {}),
    }
    save_hashed(payload, path)
    return Path(path)


def save_optimizer_state(directory: str | Path, state: dict) -> Path:
    """``<directory>/optimizer.pt``: an optimiser's ``state_dict()`` (torch optimisers: tensors and plain data)."""
    path = Path(directory) / OPTIMIZER_FILE
    save_hashed(state, path)
    return path


def load_optimizer_state(directory: str | Path) -> dict | None:
    """What :func:`save_optimizer_state` wrote in ``directory``, or None when there is none."""
    path = Path(directory) / OPTIMIZER_FILE
    return _load(path) if path.is_file() else None


def load_rollout(path: str | Path) -> tuple[RolloutBatch, dict]:
    """The rollout and its payload (``step``, ``meta``) from a file :func:`save_rollout` wrote (weights_only)."""
    payload = _load(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "tensors" not in payload:
        raise ValueError(f"{path} is not a rollout file written by lit_gspo (--model.generation.dump_every_n_steps)")
    known = {f.name for f in fields(RolloutBatch)}
    tensors = {k: v for k, v in payload["tensors"].items() if k in known}
    routing = RoutingRecord(list(payload["routing"])) if payload.get("routing") else None
    return RolloutBatch(prompt_length=payload["prompt_length"], routing=routing, **tensors), payload


def _load(path: Path):
    """A file written by :func:`save_hashed`, its hash checked; tensors and plain data only."""
    return load_verified(path, lambda: torch.load(path, map_location="cpu", weights_only=True))
