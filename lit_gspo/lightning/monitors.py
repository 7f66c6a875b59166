"""The metrics a monitor can follow, known when the module is built: a misspelt one is refused before the fit starts.

A ``ReduceLROnPlateau``'s ``monitor`` and a callback's (``ModelCheckpoint``, ``EarlyStopping``) name a metric the fit
logs. Which ones a run logs is known from its components:

* ``val/*`` (each validation): ``val/reward``, ``val/response_length``, ``val/clipped_ratio``, each reward function's
  ``val/rewards/<name>/mean``, a multi-turn environment's episode metrics and, sampled, ``val/pass@<k>``;
* ``train/*`` (each RL step): lit_gspo's own stages log only :data:`TRAIN_NAMES` and :data:`TRAIN_PATTERNS` (a superset:
  some only with some objectives or settings), each reward function's ``rewards/<name>/mean|std`` and the environment's
  ``metric_names``. A component of the user's own may log other names (a reward function that is given ``log_metric``,
  an environment, an objective, an update hook): then no ``train/*`` name is refused here, and one the first step does
  not log is refused then (``lit_gspo.lightning.plateau.step_plateau``, the callbacks' own checks).

Names outside ``val/`` and ``train/`` (``time/*``, ``step``, a metric a subclass logs) are not judged. A name refused here
is never logged; ``tests/test_monitors.py`` runs steps of the built-in components and checks each name they log is
accepted.
"""

from __future__ import annotations

import difflib
import inspect
import re
from dataclasses import dataclass

from jsonargparse import Namespace

from lit_gspo.lightning.validation import VALIDATION_NAMES, validation_metric_keys
from lit_gspo.runtime.user_errors import SettingsError

#: train/* names (without the prefix) lit_gspo's collector, learner, objectives, hooks and asynchronous rollouts log
TRAIN_NAMES = (
    # the collector: rewards, lengths, sampling
    *("reward", "reward_std", "reward_all_groups", "reward_failed", "response_length"),
    *("frac_zero_std_groups", "sampling_rounds", "clipped_ratio"),
    # the learner and the objectives' records
    *("loss", "grad_norm", "nonfinite_steps", "rows_with_gradient", "lr", "entropy", "kl"),
    *("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "is_clip_frac", "cov_clip_frac", "cov_mean"),
    *("kl_cov_frac", "divergence_mean", "gate_weight", "ratio_mean", "ratio_min", "ratio_max"),
    *("value_loss", "value_clip_frac", "routing_volatility", "staleness", "high_entropy_token_frac"),
    *("entropy_coef", "entropy_coef_applied", "router_aux_loss"),
    # multi-turn episodes
    *("turns", "truncated_episodes", "success", "success_after_feedback"),
)
#: the families of train/* names whose last part depends on the data or the settings (``*``: any text, ``<k>``: a number)
TRAIN_PATTERNS = ("ratio/*", "mismatch/*", "routing/*", "async/*", "success_turn<k>", "reached_turn<k>")


def _matches(pattern: str, name: str) -> bool:
    regex = re.escape(pattern).replace(r"\*", ".+").replace("<k>", r"\d+")
    return re.fullmatch(regex, name) is not None


def is_own(component) -> bool:
    """Whether ``component`` (an object, a function or a class) is lit_gspo's."""
    module = (
        getattr(component, "__module__", None) if inspect.isroutine(component) or inspect.isclass(component) else None
    )
    module = module or type(component).__module__
    return module == "lit_gspo" or module.startswith("lit_gspo.")


def _may_log_metrics(fn, convention) -> bool:
    """Whether a reward function of the user's own is given ``log_metric`` (named, or under ``**kwargs``)."""
    if is_own(fn):
        return False
    params = convention.signature.parameters.values() if convention.signature is not None else None
    return params is None or any(p.kind is p.VAR_KEYWORD or p.name == "log_metric" for p in params)


@dataclass
class LoggedNames:
    """The ``val/*`` names a fit logs, the ``train/*`` names and families it can log, and what of the user's own may
    log other ``train/*`` names (None: nothing)."""

    val: list[str]
    train: list[str]
    train_patterns: tuple[str, ...]
    open_by: str | None

    def may_log(self, name: str) -> bool:
        if name.startswith("val/"):
            return name in self.val
        if name.startswith("train/"):
            short = name.removeprefix("train/")
            return (
                self.open_by is not None or name in self.train or any(_matches(p, short) for p in self.train_patterns)
            )
        return True

    def refusal(self, given: str, name: str) -> str:
        """One line: ``given`` (the option and where) never logged, the close names and the ones logged."""
        split = name.split("/", 1)[0]
        known = self.val if split == "val" else self.train
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        families = ", ".join(f"train/{p}" for p in self.train_patterns)
        return (
            f"{given}: never logged by this run"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f"; each validation logs {', '.join(self.val)}; each RL step logs among {', '.join(self.train)} "
            f"and {families}"
        )


def logged_names(module) -> LoggedNames:
    """The names ``module`` (an ``RLModule``) logs in a fit."""
    collector = module.collector
    rewards, environment = collector.rewards, collector.environment
    train = [f"train/{n}" for n in TRAIN_NAMES]
    train += [f"train/rewards/{name}/{s}" for name in rewards.names for s in ("mean", "std")]
    train += [f"train/{n}" for n in environment.metric_names]
    return LoggedNames(
        val=list(
            dict.fromkeys(
                [
                    *VALIDATION_NAMES,
                    *(f"val/{key}" for key in validation_metric_keys(collector)),
                    *(f"val/pass@{k}" for k in module.validation.pass_ks()),
                ]
            )
        ),
        train=list(dict.fromkeys(train)),
        train_patterns=TRAIN_PATTERNS,
        open_by=_own_names_by(module),
    )


def _own_names_by(module) -> str | None:
    """The first component of the user's own that may log train/* names lit_gspo does not know, or None."""
    rewards = module.collector.rewards
    for fn, name, conv in zip(rewards.functions, rewards.names, rewards.conventions):
        if _may_log_metrics(fn, conv):
            return f"reward function {name}"
    for what, component in (("environment", module.collector.environment), ("objective", module.objective)):
        if not is_own(component):
            return f"{what} {type(component).__name__}"
    hook = next((h for h in module.learner.hooks.hooks if not is_own(h)), None)
    return f"update hook {type(hook).__name__}" if hook is not None else None


def check_monitors(names: LoggedNames, monitors: list[tuple[str, str]]) -> None:
    """``monitors``: (how the monitor was given, the metric name); one never logged is refused in one line."""
    for given, name in monitors:
        if isinstance(name, str) and not names.may_log(name):
            raise SettingsError(names.refusal(given, name))


def config_monitors(cfg: Namespace) -> list[tuple[str, str]]:
    """The monitors a parsed ``fit`` config gives: a ReduceLROnPlateau's, and each callback's, with the option that
    sets it and (a callback) its place in the config."""
    from lit_gspo.lightning.component_errors import class_specs

    found = []
    for path, spec in class_specs(cfg):
        monitor = (spec.get("init_args") or Namespace()).get("monitor") if "class_path" in spec else None
        if not isinstance(monitor, str):
            continue
        option = "--" + re.sub(r"\[\d+\]|\.init_args\b", "", path) + ".monitor"
        where = f" ({path}, {str(spec['class_path']).rpartition('.')[2]})" if "[" in path else ""
        found.append((f"{option} {monitor}{where}", monitor))
    return found


def object_monitors(plateau_monitor: str | None, callbacks: list) -> list[tuple[str, str]]:
    """The monitors of a module's schedule and of a Trainer's callbacks (Python API), named as in Python."""
    found = [(f"ReduceLROnPlateau(monitor={plateau_monitor!r})", plateau_monitor)] if plateau_monitor else []
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str):
            found.append((f"{type(callback).__name__}(monitor={monitor!r})", monitor))
    return found
