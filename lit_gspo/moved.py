"""Module paths from before the package was laid out as ``rl/``, ``models/``, ``data/``, ``runtime/``, ``lightning/``
and ``tools/`` keep importing: a class path in a user's YAML (``lit_gspo.objectives.GSPO``,
``lit_gspo.envs.calculator.calculator``), a ``from lit_gspo.learner import Learner`` in a script, a pickled reference.

``import lit_gspo.objectives`` gives the very module ``lit_gspo.rl.objectives`` (the same object, so classes compare
equal whichever path named them); a module that was split in several (``lit_gspo.checkpointing``) gives a module whose
names resolve to their new homes, and an unknown name there raises an ``AttributeError`` listing where each went.
Installed by ``import lit_gspo``; nothing is imported until an old path is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: old module (below ``lit_gspo.``) → its new path; a package's submodules follow it
MOVED = {
    "config": "rl.config", "rollout": "rl.rollout", "rollout_io": "rl.rollout_io",
    "collect": "rl.collect", "episodes": "rl.collect.episodes",
    "engines": "rl.engines", "fast_generate": "rl.engines.fast_generate",
    "envs": "rl.envs", "rewards": "rl.rewards", "objectives": "rl.objectives", "advantages": "rl.advantages",
    "learner": "rl.learn.learner", "mismatch": "rl.learn.mismatch", "diagnostics": "rl.learn.diagnostics",
    "evaluate": "rl.evaluate", "warm_start": "rl.warm_start",
    "hardware": "runtime.hardware", "optim": "runtime.optim", "extras": "runtime.extras", "imports": "runtime.imports",
    "user_errors": "runtime.user_errors",
    "module": "lightning.module", "data.datamodule": "lightning.datamodule", "rlcli": "lightning.cli",
    "run_dir": "lightning.run_dir", "metrics_file": "lightning.metrics_file", "completions_log": "lightning.completions_log",
    "progress": "lightning.progress", "quiet": "lightning.quiet",
    "cli": "tools.main", "eval_cli": "tools.eval", "compare": "tools.compare", "compare_report": "tools.compare_report",
    "ablate": "tools.ablate", "ablate_report": "tools.ablate_report",
}

#: old module that was split → {public name: its new module}
SPLIT = {
    "distributed": {
        **dict.fromkeys(["world_size", "all_reduce_sum", "sum_over_ranks", "gather_objects", "reduce_weighted_means",
                         "reduce_step_stats", "check_ranks_resume_alike"], "runtime.collectives"),
        **dict.fromkeys(["decoder_layers", "is_sharded", "shard_model", "apply_fsdp2", "unsharded_class",
                         "full_state_dict"], "runtime.sharding"),
        **dict.fromkeys(["FSDP1_MESSAGE", "is_fsdp1_strategy", "strategy_from_path", "check_strategy"], "lightning.strategy"),
    },
    "checkpointing": {
        **dict.fromkeys(["CheckpointError", "SHA256_SUFFIX", "sha256_path", "refuse_remote", "verify_checkpoint",
                         "describe_load_error"], "runtime.checkpoint_files"),
        **dict.fromkeys(["written_aside", "export_is_complete"], "runtime.files"),
        **dict.fromkeys(["local_rng_state", "rng_states", "restore_rng_states", "restore_local_rng_state"], "runtime.rng"),
        "AtomicCheckpointIO": "lightning.checkpoint_io", "AtomicModelParallelStrategy": "lightning.strategy",
        "LastCheckpoint": "lightning.callbacks.last_checkpoint",
        "configure_checkpointing": "lightning.callbacks.last_checkpoint",
    },
    "hub": {**dict.fromkeys(["hub_offline", "hub_endpoint", "hub_unreachable", "offline_hint"], "runtime.hub"),
            **dict.fromkeys(["HubPushError", "check_can_push", "push_export"], "models.push")},
    "safe_ends": {
        **dict.fromkeys(["RunLockedError", "RunLock", "OneRunPerDirectory"], "lightning.callbacks.run_lock"),
        **dict.fromkeys(["RunInterrupted", "SaveOnSignal", "last_checkpoint_path"], "lightning.callbacks.signals"),
        **dict.fromkeys(["ResumeAlike", "ContinueLogsOnResume"], "lightning.callbacks.resume"),
        "clean_stale_temporaries": "lightning.callbacks.temporaries", "pid_alive": "runtime.processes",
        "end_with_parent": "runtime.processes",
    },
}

#: a name that left a package that stayed → the module it lives in now
MOVED_NAMES = {"lit_gspo.data": dict.fromkeys(["PromptDataModule", "PromptLoader", "ResumableSampler", "RowDataset"],
                                              "lit_gspo.lightning.datamodule")}

PACKAGE = "lit_gspo"


def moved_name(module: str, name: str):
    """``module.name`` of before the layout, from where it lives now (a package's ``__getattr__`` calls this)."""
    if name not in MOVED_NAMES.get(module, {}):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return getattr(importlib.import_module(MOVED_NAMES[module][name]), name)


def new_path(old: str) -> str | None:
    """The new dotted path of the old module ``old`` (``lit_gspo.objectives.gspo`` → ``lit_gspo.rl.objectives.gspo``)."""
    rest = old[len(PACKAGE) + 1:]
    for prefix in sorted(MOVED, key=len, reverse=True):
        if rest == prefix or rest.startswith(prefix + "."):
            return f"{PACKAGE}.{MOVED[prefix]}{rest[len(prefix):]}"
    return None


def split_module(old: str) -> types.ModuleType:
    """A module whose attributes are looked up in the modules ``old`` was split into."""
    homes = SPLIT[old[len(PACKAGE) + 1:]]
    module = types.ModuleType(old, f"{old} was split: its names now live in " + ", ".join(
        sorted({f"{PACKAGE}.{home}" for home in homes.values()})))

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"{old} was split and {name!r} is not one of its public names; where they went: "
                                 + ", ".join(f"{n} → {PACKAGE}.{h}" for n, h in sorted(homes.items())))
        return getattr(importlib.import_module(f"{PACKAGE}.{homes[name]}"), name)

    module.__getattr__ = __getattr__
    module.__all__ = sorted(homes)
    return module


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as the module that now lives at the new path."""

    def __init__(self) -> None:
        self._targets: dict[str, tuple[types.ModuleType, importlib.machinery.ModuleSpec]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        if fullname[len(PACKAGE) + 1:] in SPLIT:
            return importlib.machinery.ModuleSpec(fullname, self)
        moved_to = new_path(fullname)
        if moved_to is None:
            return None
        module = importlib.import_module(moved_to)
        self._targets[fullname] = (module, module.__spec__)
        return importlib.machinery.ModuleSpec(fullname, self, origin=module.__spec__.origin,
                                              is_package=hasattr(module, "__path__"))

    def create_module(self, spec):
        if spec.name in self._targets:
            return self._targets[spec.name][0]
        return split_module(spec.name)

    def get_code(self, fullname):
        """``python -m lit_gspo.cli`` (an old path) runs the moved module's code as ``__main__``."""
        module = self._targets[fullname][0] if fullname in self._targets else None
        return None if module is None else module.__spec__.loader.get_code(module.__name__)

    def exec_module(self, module):
        if module.__spec__.name in self._targets:  # the import system gave the moved module the alias's spec
            module.__spec__ = self._targets.pop(module.__spec__.name)[1]


def install() -> None:
    """Put the alias finder first in ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
