"""One run per directory: ``lit-gspo fit`` never writes into another run, and a checkpoint knows its run's config.

A *run* is what one fit and its resumes write into ``trainer.default_root_dir`` (the *root*): ``checkpoints/``,
``hf_model/``, ``lightning_logs/``, and ``run_config.yaml``, the run's settings (the parsed config, as
LightningCLI's ``config.yaml``; ``lit-gspo fit --config <root>/run_config.yaml`` repeats the run). A root *holds a
run* once it has a checkpoint or an export (:func:`holds_run`): a fit that failed before its first checkpoint leaves
nothing another fit could overwrite.

Where the CLI's ``fit`` goes (:func:`place`, called before anything is built):

* a fresh fit (no ``--ckpt_path``) into a root that holds a run goes to the first free sibling, ``<root>-2``,
  ``<root>-3``, ... (``run-2``, ... inside the working directory when no root is given), and says so in one line.
  Whatever its settings: a fresh run never continues or overwrites another one's checkpoints, metrics or
  ``hf_model`` (a second run with the same settings, e.g. to check a seed, gets its own directory too);
* ``--ckpt_path last`` resumes the run of the root, or of a sibling, whose settings are this fit's (same settings:
  the same run); when runs are there but none has these settings, it is refused, naming the differing settings.
  With no run there it starts one (Lightning's behaviour; a job restarted on preemption can always pass ``last``);
* ``--ckpt_path <file>`` resumes the run that wrote the file (the directory above its ``checkpoints/``) when the
  settings agree, and is refused naming the differing settings when they do not.

A refused resume writes nothing: the refusal comes before the Trainer is built, and :class:`RunConfigCallback` writes
the config files only once training starts (after the checkpoint has been loaded).

Settings compared: every key of the saved config except :data:`IGNORED`, the keys that say how long a run goes, where
and how it is observed, not what it computes: ``ckpt_path``/``weights_only`` (how this fit starts),
``trainer.max_steps``/``max_epochs``/``max_time``/``min_*`` (a resume may extend a run), ``trainer.default_root_dir``
(where; a run is found by its settings), the progress bar, model summary, loggers, callbacks, logging and profiling
flags, ``checkpoint_every_n_steps`` and the hub upload. Everything else (model, objective, optimiser, rewards, data,
seeds, precision, devices, strategy) must be equal for a resume.

The link from a checkpoint or an export to its config (:func:`config_for`, read by ``lit-gspo eval``): the config is
stored in every checkpoint (:data:`CHECKPOINT_KEY`), beside the export (:data:`EXPORT_CONFIG`, when the export calls
:func:`save_export_config`) and in the run's ``run_config.yaml``. How many processes the run validated on
(:func:`world_size_of`, so that ``eval`` samples as they did): a checkpoint holds one RNG state per process, an export
says it in :data:`EXPORT_PROCESSES`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import yaml
from lightning.pytorch.cli import SaveConfigCallback

from lit_gspo.lightning.run_state import RNG_STATES
from lit_gspo.runtime.user_errors import RunDirError

RUN_CONFIG = "run_config.yaml"
CHECKPOINT_KEY = "lit_gspo_config"
#: the run's log folder (``version_N`` of ``<root>/lightning_logs``), stored in each checkpoint: a resume continues it
LOG_VERSION_KEY = "lit_gspo_log_version"
LOGS = "lightning_logs"
EXPORT_CONFIG = "lit_gspo_config.yaml"
#: beside an export: ``{"world_size": W}``, the processes its run ran on
EXPORT_PROCESSES = "lit_gspo_processes.json"
EXPORTS = ("hf_model", "hf_adapter")
#: the CLI's subcommands that score a model: each logs to ``lightning_logs/<subcommand>/``, beside any run
SCORING = ("validate", "test", "predict")

#: keys (and their sub-keys) that may differ between a run and its resume
IGNORED = (
    "config",
    "ckpt_path",
    "weights_only",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_time",
    "trainer.min_steps",
    "trainer.min_epochs",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.logger",
    "trainer.callbacks",
    "trainer.log_every_n_steps",
    "trainer.profiler",
    "checkpoint_every_n_steps",
    "push_to_hub",
    "hub_private",
)


# ---------------------------------------------------------------------------------------------------- comparing
def flatten(tree, prefix: str = "") -> dict:
    """``{"model": {"seed": 1}}`` → ``{"model.seed": 1}``; lists are values (compared whole)."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def settings_of_run(path: Path, defaults: dict) -> dict:
    """The flat settings a run saved in ``path``, and the ``defaults`` (flat) of settings it did not have: a run of an
    earlier lit_gspo ran as a setting added since behaves by default, so resuming it is not a change of settings."""
    tree = load_yaml(path)
    saved = flatten(tree)
    unknown = {
        key: value
        for key, value in defaults.items()
        if not any(s == key or s.startswith(key + ".") or key.startswith(s + ".") for s in saved)
    }
    return {**saved, **unknown}


def _ignored(key: str, ignored: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in ignored)


def differences(saved: dict, current: dict, ignored: tuple[str, ...] = IGNORED) -> dict[str, tuple]:
    """Dotted key → (saved value, current value) for every compared setting that differs."""
    a, b = flatten(saved), flatten(current)
    missing = object()
    out = {}
    for key in sorted(set(a) | set(b)):
        if _ignored(key, ignored):
            continue
        old, new = a.get(key, missing), b.get(key, missing)
        if old != new:
            out[key] = tuple("(unset)" if v is missing else v for v in (old, new))
    return out


def describe(diffs: dict[str, tuple], limit: int = 6) -> str:
    """``model.objective.class_path: lit_gspo.rl.objectives.GSPO → lit_gspo.rl.objectives.DAPO, seed_everything: 0 → 1``"""
    swapped = [k[: -len(".class_path")] for k in diffs if k.endswith(".class_path")]
    # another class: its init_args differ as a consequence, the class is what to name
    diffs = {k: v for k, v in diffs.items() if not any(k.startswith(f"{c}.init_args.") for c in swapped)}
    items = [f"{k}: {_short(old)} → {_short(new)}" for k, (old, new) in list(diffs.items())[:limit]]
    more = len(diffs) - limit
    return ", ".join(items) + (f" and {more} more" if more > 0 else "")


def _short(value) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------------- run dirs
def holds_run(root: Path) -> bool:
    """Whether ``root`` has a checkpoint or an export that another fit would overwrite."""
    checkpoints = root / "checkpoints"
    return (checkpoints.is_dir() and any(checkpoints.glob("*.ckpt"))) or any((root / e).is_dir() for e in EXPORTS)


def saved_config_path(root: Path) -> Path | None:
    """The run's ``run_config.yaml``; for runs written before it existed, the newest ``*/version_*/config.yaml``."""
    if (root / RUN_CONFIG).is_file():
        return root / RUN_CONFIG
    found = list(root.glob("*/version_*/config.yaml"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def dump(parser, cfg) -> str:
    """``parser.dump(cfg)`` with the nulls kept, as LightningCLI's ``SaveConfigCallback`` saves it."""
    with warnings.catch_warnings():  # jsonargparse 4.49+ deprecates skip_none, which Lightning itself still passes
        warnings.filterwarnings("ignore", message=".*skip_none.*", category=DeprecationWarning)
        return parser.dump(cfg, skip_none=False)


def load_yaml(path_or_text: Path | str) -> dict:
    text = path_or_text.read_text() if isinstance(path_or_text, Path) else path_or_text
    loaded = yaml.safe_load(text)
    return loaded if isinstance(loaded, dict) else {}


def siblings(root: Path, given: bool) -> list[Path]:
    """``root`` and the directories a fresh fit moves to when it holds a run: ``<root>-2``, ``<root>-3``, ... (existing
    ones, then the next free name); ``run-2``, ... inside ``root`` when no root was given (the working directory)."""
    name = (lambda i: root.parent / f"{root.name}-{i}") if given else (lambda i: root / f"run-{i}")
    out, i = [root], 2
    while name(i).exists():
        out.append(name(i))
        i += 1
    return out + [name(i)]


@dataclass
class Placement:
    root: Path  # where this fit writes
    note: str | None  # one line for the user when it is not the root asked for


def _newest_checkpoint_time(root: Path) -> float:
    return max((p.stat().st_mtime for p in (root / "checkpoints").glob("*.ckpt")), default=0.0)


def place(root: Path, given: bool, current: dict, ckpt_path: str | None, defaults: dict | None = None) -> Placement:
    """Where a fit with settings ``current`` (the parsed config as a dict) and ``ckpt_path`` writes; raises
    :class:`RunDirError` for a resume whose settings differ from its run's (module docstring). ``defaults``: every
    setting's default, for the settings a run saved by an earlier version of lit_gspo did not have (it ran as their
    default does)."""
    saved_settings = partial(settings_of_run, defaults=flatten(defaults or {}))
    if ckpt_path in ("hpc", "best"):  # Lightning's other names: not a run of ours to compare with
        return Placement(root, None)
    if ckpt_path and ckpt_path != "last":
        return _place_resume_from_file(root, given, current, Path(ckpt_path), saved_settings)
    if ckpt_path == "last":
        return _place_resume_last(root, given, current, saved_settings)
    return _place_fresh(root, given, current, saved_settings)


def _place_fresh(root: Path, given: bool, current: dict, saved_settings) -> Placement:
    if not holds_run(root):
        return Placement(root, None)
    free = next(d for d in siblings(root, given) if not holds_run(d))
    saved = saved_config_path(root)
    diffs = differences(saved_settings(saved), current) if saved else None
    what = (
        "a run with other settings (" + describe(diffs) + ")"
        if diffs
        else "a run with these settings (--ckpt_path last resumes it)"
        if diffs is not None
        else "a run"
    )
    return Placement(
        free, f"{root} holds {what}; this run writes to {free} (--trainer.default_root_dir chooses the directory)"
    )


def _place_resume_last(root: Path, given: bool, current: dict, saved_settings) -> Placement:
    runs = [d for d in siblings(root, given) if holds_run(d)]
    if not runs:
        return Placement(root, None)  # nothing to resume: a new run (Lightning says so too)
    diffs = {}
    for run in runs:
        saved = saved_config_path(run)
        diffs[run] = differences(saved_settings(saved), current) if saved else {}
    same = [run for run in runs if not diffs[run]]
    if root in same:
        return Placement(root, None)
    if same:
        run = max(same, key=_newest_checkpoint_time)
        return Placement(
            run, f"resuming the run in {run}, the one with these settings ({root} holds a run with other settings)"
        )
    first = runs[0]
    raise RunDirError(
        f"--ckpt_path last: {first} holds a run with other settings than this fit's: {describe(diffs[first])}"
        f". A resume continues a run with its own settings (they are in {saved_config_path(first)}); "
        "to train with these settings, start a new run (without --ckpt_path)"
    )


def run_of_checkpoint(path: Path) -> Path:
    """The run directory of a checkpoint: the one above its ``checkpoints/`` folder, else the folder itself."""
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def _place_resume_from_file(root: Path, given: bool, current: dict, path: Path, saved_settings) -> Placement:
    if not path.exists():
        raise RunDirError(
            f"--ckpt_path {path}: no such file (a run's checkpoints are <run>/checkpoints/*.ckpt; "
            "--ckpt_path last takes the newest of this run)"
        )
    run = run_of_checkpoint(path)
    saved = saved_config_path(run)
    diffs = differences(saved_settings(saved), current) if saved else {}
    if diffs:
        raise RunDirError(
            f"--ckpt_path {path}: the run that wrote it had other settings than this fit's: "
            f"{describe(diffs)}. A resume continues a run with its own settings (they are in {saved}); "
            "to train from these weights with other settings, start a new run from an exported model "
            "(--model.policy.name <run>/hf_model)"
        )
    if root.resolve() == run.resolve():
        return Placement(root, None)
    return _place_fresh(root, given, current, saved_settings)  # the checkpoint's run resumed into another directory


def group_defaults(module_class=None) -> dict:
    """``{"validation": {...}, ...}``: each settings group of ``RLModule`` (a dataclass parameter) with its defaults."""
    if module_class is None:
        from lit_gspo.lightning.module import RLModule as module_class
    out = {}
    for name, hint in typing.get_type_hints(module_class.__init__).items():
        for cls in typing.get_args(hint) or (hint,):
            if dataclasses.is_dataclass(cls):
                out[name] = dataclasses.asdict(cls())
    return out


# ---------------------------------------------------------------------------------------------------- the CLI hook
def place_fit(cli) -> None:
    """``RLCLI.before_instantiate_classes`` for ``fit``: compare, and set ``trainer.default_root_dir`` (or refuse)."""
    cfg = cli.config[cli.subcommand]
    given = cfg.get("trainer.default_root_dir")
    root = Path(given or os.getcwd())
    parser = cli.parser.subcommands_action.choices[cli.subcommand]  # the fit parser (jsonargparse's public map)
    current = load_yaml(dump(parser, cfg))
    defaults = load_yaml(dump(parser, parser.get_defaults()))
    if isinstance(defaults.get("model"), dict):  # a group left null runs with its dataclass's defaults
        defaults["model"].update(group_defaults(type(cli.model) if hasattr(cli, "model") else None))
    placement = place(root, bool(given), current, cfg.get("ckpt_path"), defaults)
    if _is_rank_zero():  # the run lock, before anything is built: warm start and step-0 validation run under it
        from lit_gspo.lightning.cli import device_count

        trainer = cfg.get("trainer")
        processes = (trainer.get("num_nodes") or 1) * device_count(trainer.get("devices"), trainer.get("accelerator"))
        placement = lock_placement(placement, root, bool(given), cfg.get("ckpt_path"), processes > 1)
    if placement.root != root:
        cfg["trainer.default_root_dir"] = str(placement.root)
    if placement.note and _is_rank_zero():
        print(f"fit: {placement.note}", flush=True)


def lock_placement(placement: Placement, root: Path, given: bool, ckpt_path: str | None, several: bool) -> Placement:
    """Take the run lock of ``placement.root`` (``lit_gspo.lightning.callbacks.run_lock``) for this fit, before it
    builds or writes anything. A fresh fit whose directory another live fit holds (one that has no checkpoint yet)
    goes to the next free sibling, as it would beside a finished run, and says so; a resume, or a fit of several
    processes (whose other ranks place themselves without the lock), is refused at once with the holder's command.
    A refused fit leaves nothing in the directory it was refused."""
    from lit_gspo.lightning.callbacks.run_lock import RunLock, RunLockedError

    try:
        RunLock(placement.root).acquire()
        return placement
    except RunLockedError as err:
        if ckpt_path or several:
            raise
        busy, first_error = placement.root, err
    for candidate in siblings(root, given):
        if candidate == busy or holds_run(candidate):
            continue
        try:
            RunLock(candidate).acquire()
        except RunLockedError:
            continue
        holder = str(first_error).split(" is in use by another run (", 1)[-1].split("). Two runs", 1)[0]
        return Placement(
            candidate,
            f"{busy} is in use by another fit ({holder}); this run writes to {candidate} "
            "(--trainer.default_root_dir chooses the directory)",
        )
    raise first_error


#: what launchers set for a process's place before any process group exists (torchrun, Lightning's own launches, SLURM's
#: srun, MPI, LSF): a process is the first of its run where none of them says otherwise
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "JSM_NAMESPACE_RANK",
)


def _is_rank_zero() -> bool:
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


# ---------------------------------------------------------------------------------------------------- saving
class SaveRunConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml``, also for a logger with no local directory: where the logger has one (CSV,
    TensorBoard: ``log_dir``; MLflow with a ``file:`` store, W&B: ``save_dir``) it goes there, as Lightning puts it;
    otherwise (MLflow with ``sqlite:///…`` or an ``http://`` server: ``trainer.log_dir`` is None, which Lightning's
    callback asserts against) to ``trainer.default_root_dir``."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            self.save_to_log_dir = trainer.log_dir is not None  # every rank: log_dir is a broadcast
            if not self.save_to_log_dir and not self.overwrite:
                path = os.path.join(trainer.default_root_dir, self.config_filename)
                if trainer.strategy.broadcast(trainer.is_global_zero and os.path.isfile(path)):
                    raise RuntimeError(
                        f"{path} exists: not overwriting the config of a previous run (delete it, or "
                        'give LightningCLI save_config_kwargs={"overwrite": True})'
                    )
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        """Rank 0 only (Lightning calls it there): the config to ``default_root_dir`` when the logger has no directory."""
        if not self.save_to_log_dir:
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            self.parser.save(
                self.config,
                os.path.join(trainer.default_root_dir, self.config_filename),
                skip_none=False,
                overwrite=self.overwrite,
                multifile=self.multifile,
            )


class RunConfigCallback(SaveRunConfig):
    """LightningCLI's ``SaveConfigCallback`` (``<log_dir>/config.yaml``), written when training starts rather than at
    setup, so a resume that fails to load writes nothing; also ``<root>/run_config.yaml`` and the config inside
    every checkpoint (:data:`CHECKPOINT_KEY`), the link ``lit-gspo eval`` follows."""

    _text: str | None = None

    def text(self) -> str:
        if self._text is None:
            self._text = dump(self.parser, self.config)
        return self._text

    def setup(self, trainer, pl_module, stage: str) -> None:
        pass  # deferred to on_train_start

    def on_train_start(self, trainer, pl_module) -> None:
        from lit_gspo.runtime import user_errors

        user_errors.mark_started()  # the start checks passed (checkpoint loaded, data read, rewards checked)
        super().setup(trainer, pl_module, "fit")

    def save_config(self, trainer, pl_module, stage: str) -> None:
        """Rank 0: ``<root>/run_config.yaml``, written aside then renamed (a kill leaves the old one or the new), and
        ``config.yaml`` in the root when the logger has no directory (:class:`SaveRunConfig`)."""
        super().save_config(trainer, pl_module, stage)
        path = Path(trainer.default_root_dir) / RUN_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{RUN_CONFIG}.tmp-{os.getpid()}"
        tmp.write_text(self.text())
        os.replace(tmp, path)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = self.text()
        version = log_version_of(trainer)
        if version is not None:
            checkpoint[LOG_VERSION_KEY] = version


def save_export_config(trainer, directory: str | Path) -> Path | None:
    """Write the run's config into an export directory (``hf_model/lit_gspo_config.yaml``), so a copied export still
    names its settings, and its number of processes (:data:`EXPORT_PROCESSES`); for ``RLModule``'s export to call while
    it writes ``directory``. Returns the config's path; None without the CLI's :class:`RunConfigCallback` (a plain
    ``Trainer``: the processes only; no trainer: nothing)."""
    if trainer is not None:
        (Path(directory) / EXPORT_PROCESSES).write_text(json.dumps({"world_size": trainer.world_size}) + "\n")
    callback = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, RunConfigCallback)), None)
    if callback is None:
        return None
    path = Path(directory) / EXPORT_CONFIG
    path.write_text(callback.text())
    return path


# ---------------------------------------------------------------------------------------------------- reading
@dataclass
class FoundConfig:
    text: str  # the YAML
    origin: str  # where it came from, for the user
    path: Path | None  # the file, when it is one


def config_for(model: str) -> FoundConfig | None:
    """The config of the run that wrote ``model`` (a ``.ckpt`` or an export directory such as ``<run>/hf_model``):
    the one inside the checkpoint, beside the export, the run's ``run_config.yaml``, or (runs written before those
    existed) the newest ``<run>/*/version_*/config.yaml``. None for a model of no run (a hub id, a ``.gguf``)."""
    path = Path(model)
    if path.is_file() and path.suffix == ".ckpt":
        text = _checkpoint_config(path)
        if text:
            return FoundConfig(text, f"{path} (stored in the checkpoint)", None)
        run = run_of_checkpoint(path)
    elif path.is_dir():
        if (path / EXPORT_CONFIG).is_file():
            return FoundConfig(
                (path / EXPORT_CONFIG).read_text(),
                f"{path / EXPORT_CONFIG} (saved with the model)",
                path / EXPORT_CONFIG,
            )
        run = path.parent
    else:
        return None
    saved = saved_config_path(run)
    if saved is None:
        return None
    return FoundConfig(saved.read_text(), f"{saved} (the run of {model})", saved)


def world_size_of(model: str) -> int | None:
    """How many processes the run that wrote ``model`` ran on: a ``.ckpt``'s (one RNG state per process), an
    export's (:data:`EXPORT_PROCESSES`); None for a model of no run, or an export written before that file."""
    path = Path(model)
    if path.is_file() and path.suffix == ".ckpt":
        states = _checkpoint_entry(path, RNG_STATES)
        return len(states) if isinstance(states, list) else None
    if (path / EXPORT_PROCESSES).is_file():
        return int(json.loads((path / EXPORT_PROCESSES).read_text())["world_size"])
    return None


def _checkpoint_config(path: Path) -> str | None:
    """The config stored in a checkpoint, read without loading its tensors (memory-mapped)."""
    text = _checkpoint_entry(path, CHECKPOINT_KEY)
    return text if isinstance(text, str) else None


def _checkpoint_entry(path: Path, key: str):
    """One top-level entry of a checkpoint, read without loading its tensors (memory-mapped); None when absent."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old-format or unreadable file: the run directory's config, and the loader reports the rest
        return None
    return checkpoint.get(key) if isinstance(checkpoint, dict) else None


# ---------------------------------------------------------------------------------------------------- metrics
def log_version_of(trainer) -> str | None:
    """The folder name (``version_N``) of the fit's default CSV logger, None with another logger."""
    from lit_gspo.lightning.metrics_file import RunCSVLogger

    logger = trainer.logger
    if not isinstance(logger, RunCSVLogger) or logger.name != LOGS:
        return None
    version = logger.version
    return version if isinstance(version, str) else f"version_{version}"


def checkpoint_to_resume(root: Path, ckpt_path: str | None) -> Path | None:
    """The checkpoint a fit with ``ckpt_path`` starts from when it is one of ``root``'s run (``last``: its
    ``checkpoints/last.ckpt``, else the newest ``*.ckpt`` there); None for a fresh fit or another run's file."""
    if not ckpt_path or ckpt_path in ("hpc", "best"):
        return None
    if ckpt_path == "last":
        folder = root / "checkpoints"
        if (folder / "last.ckpt").is_file():
            return folder / "last.ckpt"
        found = list(folder.glob("*.ckpt")) if folder.is_dir() else []
        return max(found, key=lambda p: p.stat().st_mtime) if found else None
    path = Path(ckpt_path)
    if path.is_file() and run_of_checkpoint(path).resolve() == root.resolve():
        return path
    return None


def resumed_log_version(root: Path, ckpt_path: str | None) -> str | None:
    """The ``version_N`` of ``<root>/lightning_logs`` a resume continues: the one its checkpoint names; for a
    checkpoint written before checkpoints named it, the newest folder holding a fit's rows (a ``train/`` column: not
    one a ``validate``, or a refused fit, created since). None: a new folder (a fresh fit, or nothing to continue)."""
    checkpoint = checkpoint_to_resume(root, ckpt_path)
    if checkpoint is None:
        return None
    logs = root / LOGS
    version = _checkpoint_entry(checkpoint, LOG_VERSION_KEY)
    if isinstance(version, str) and (logs / version).is_dir():
        return version
    fits = [d for d in logs.glob("version_*") if d.is_dir() and _has_training_rows(d / "metrics.csv")]
    if fits:
        return max(fits, key=lambda d: int(d.name.split("_", 1)[1]) if d.name.split("_", 1)[1].isdigit() else -1).name
    return None


def _has_training_rows(path: Path) -> bool:
    try:
        with open(path, newline="") as f:
            header = f.readline()
    except OSError:
        return False
    return any(column.strip().startswith("train/") for column in header.split(","))


def default_logger(subcommand: str | None, root: str, ckpt_path: str | None):
    """The CLI's logger when none is configured (``RunCSVLogger``), writing where the README says:

    * ``fit``: ``<root>/lightning_logs/version_N/metrics.csv``, a new ``version_N`` for a fresh run; a resume
      continues its run's own folder (:func:`resumed_log_version`), whatever ran in between;
    * ``validate`` / ``test`` / ``predict``: ``<root>/lightning_logs/<subcommand>/``, one ``metrics.csv`` continued by
      each call (``predict``: its ``predictions.jsonl``), never a ``version_N`` (which a resume of the run would take for
      its own)."""
    from lit_gspo.lightning.metrics_file import RunCSVLogger

    if subcommand in SCORING:
        return RunCSVLogger(save_dir=root, name=LOGS, version=subcommand)
    version = resumed_log_version(Path(root), ckpt_path)
    return RunCSVLogger(save_dir=root, name=LOGS, version=version)
