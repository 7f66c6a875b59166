"""One run per directory, resumes only with the run's settings, and eval reads the checkpoint's own config
(issue 29, findings 5 and 6; ``lit_gspo/lightning/run_dir.py``)."""

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from lit_gspo.lightning import run_dir
from lit_gspo.tools.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model.policy.warm_start.steps",
    "3",
    "--model.validation.every_n_steps",
    "0",
    "--data.num_train",
    "32",
    "--data.num_val",
    "4",
    "--data.prompts_per_step",
    "4",
    "--model.generation.num_generations",
    "4",
    "--model.generation.max_new_tokens",
    "4",
    "--trainer.enable_progress_bar",
    "false",
]


def fit(root: Path, *extra: str, steps: int = 2) -> None:
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.default_root_dir",
            str(root),
            *TINY,
            "--trainer.max_steps",
            str(steps),
            *extra,
        ]
    )


def refused(capsys, call, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        call(*args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (in-process: warnings go there too)
    assert len(errors) == 1, err
    return errors[0]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` → its content hash (what a refused command must leave as it was)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def rl_step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["rl_step"]


# ------------------------------------------------------------------------------------------- the comparison alone
def test_differences_ignore_what_a_resume_may_change_and_name_the_rest():
    saved = {
        "seed_everything": 0,
        "ckpt_path": None,
        "trainer": {"max_steps": 500, "enable_progress_bar": True, "devices": 1, "default_root_dir": "runs/a"},
        "model": {"objective": {"class_path": "GSPO"}, "rewards": [1]},
    }
    resume = {
        "seed_everything": 0,
        "ckpt_path": "last",
        "trainer": {"max_steps": 900, "enable_progress_bar": False, "devices": 1, "default_root_dir": "runs/b"},
        "model": {"objective": {"class_path": "GSPO"}, "rewards": [1]},
    }
    assert run_dir.differences(saved, resume) == {}
    other = {
        **resume,
        "seed_everything": 1,
        "trainer": {**resume["trainer"], "devices": 2},
        "model": {"objective": {"class_path": "DAPO"}, "rewards": [1, 2]},
    }
    assert run_dir.differences(saved, other) == {
        "model.objective.class_path": ("GSPO", "DAPO"),
        "model.rewards": ([1], [1, 2]),
        "seed_everything": (0, 1),
        "trainer.devices": (1, 2),
    }
    assert run_dir.describe({"seed_everything": (0, 1)}) == "seed_everything: 0 → 1"
    # another class: named once, not with each init_arg that differs because of it
    assert run_dir.describe(
        {
            "model.objective.class_path": ("GSPO", "DAPO"),
            "model.objective.init_args.dual_clip": ("(unset)", None),
            "data.seed": (None, 1),
        }
    ) == ("model.objective.class_path: GSPO → DAPO, data.seed: null → 1")
    assert run_dir.differences({"a": 1}, {}) == {"a": (1, "(unset)")}


def test_a_fresh_fit_goes_to_the_first_sibling_without_a_run(tmp_path):
    root = tmp_path / "q"
    assert run_dir.place(root, True, {}, None).root == root  # nothing there
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (root / "run_config.yaml").write_text("seed_everything: 0\n")
    placed = run_dir.place(root, True, {"seed_everything": 0}, None)
    assert placed.root == tmp_path / "q-2" and "these settings (--ckpt_path last resumes it)" in placed.note
    (tmp_path / "q-2" / "hf_model").mkdir(parents=True)
    assert run_dir.place(root, True, {"seed_everything": 3}, None).root == tmp_path / "q-3"
    # no root given: the working directory's runs go to run-2, run-3, ... inside it
    assert run_dir.place(root, False, {}, None).root == root / "run-2"


# ------------------------------------------------------------------------------------------- real fits
@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs") / "q"
    fit(root)
    return root


def test_a_second_fit_with_other_settings_gets_its_own_directory(first_run, capsys):
    before = tree(first_run)
    fit(first_run, "--model.objective", "DAPO", "--seed_everything", "1")
    out = capsys.readouterr().out
    other = first_run.parent / "q-2"
    assert f"fit: {first_run} holds a run with other settings (" in out and "seed_everything: 0 → 1" in out
    assert f"this run writes to {other}" in out
    assert tree(first_run) == before  # not one file of the first run changed
    assert yaml.safe_load((other / "run_config.yaml").read_text())["seed_everything"] == 1
    assert (other / "hf_model" / "model.safetensors").is_file() and rl_step(other / "checkpoints" / "last.ckpt") == 2


def test_a_resume_with_other_settings_is_refused_naming_them_and_writes_nothing(first_run, capsys):
    before = {d: tree(d) for d in first_run.parent.iterdir()}
    err = refused(capsys, fit, first_run, "--ckpt_path", "last", "--model.objective.init_args.clip_high", "0.01")
    assert err.startswith("error: --ckpt_path last: ") and "model.objective.init_args.clip_high: 0.0004 → 0.01" in err
    err = refused(
        capsys, fit, first_run, "--ckpt_path", str(first_run / "checkpoints" / "last.ckpt"), "--seed_everything", "5"
    )
    assert "the run that wrote it had other settings than this fit's: seed_everything: 0 → 5" in err
    assert {d: tree(d) for d in first_run.parent.iterdir()} == before  # no config.yaml, hparams.yaml, metrics rewritten


def test_a_resume_with_the_runs_settings_continues_it_and_last_finds_a_siblings_run(first_run, capsys):
    fit(first_run, "--ckpt_path", "last", steps=3)  # the run's settings; a resume may extend max_steps
    assert rl_step(first_run / "checkpoints" / "last.ckpt") == 3
    assert "fit:" not in capsys.readouterr().out
    other = first_run.parent / "q-2"  # the DAPO, seed 1 run: `last` with its settings resumes it, where it is
    if not other.exists():
        pytest.skip("needs the run of test_a_second_fit_with_other_settings_gets_its_own_directory")
    fit(first_run, "--model.objective", "DAPO", "--seed_everything", "1", "--ckpt_path", "last", steps=3)
    assert f"resuming the run in {other}" in capsys.readouterr().out
    assert rl_step(other / "checkpoints" / "last.ckpt") == 3 and rl_step(first_run / "checkpoints" / "last.ckpt") == 3


def test_the_config_travels_in_the_checkpoint_and_beside_the_run(first_run):
    ckpt = first_run / "checkpoints" / "last.ckpt"
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)[run_dir.CHECKPOINT_KEY]
    assert yaml.safe_load(stored)["seed_everything"] == 0
    found = run_dir.config_for(str(ckpt))
    assert found.text == stored and found.origin == f"{ckpt} (stored in the checkpoint)"
    found = run_dir.config_for(str(first_run / "hf_model"))  # the export carries it (a copied hf_model/ too)
    assert found.path == first_run / "hf_model" / run_dir.EXPORT_CONFIG
    assert found.text == (first_run / "run_config.yaml").read_text() == stored


# ------------------------------------------------------------------------------------------- eval (finding 6)
def test_eval_scores_a_checkpoint_with_its_own_runs_config_not_the_newest_one(first_run, capsys, tmp_path):
    """Before: eval read the newest ``version_*/config.yaml`` of the directory, another run's when two shared it."""
    other = first_run.parent / "q-2"
    if not other.exists():
        pytest.skip("needs the run of test_a_second_fit_with_other_settings_gets_its_own_directory")
    out_json = tmp_path / "e.json"
    main(["eval", "--ckpt", str(other / "checkpoints" / "last.ckpt"), "--samples", "0", "--output", str(out_json)])
    out = capsys.readouterr().out
    assert f"eval: reading the run's config: {other / 'checkpoints' / 'last.ckpt'} (stored in the checkpoint)" in out
    assert yaml.safe_load(out_json.read_text())["seed"] == 1


def test_eval_refuses_a_config_file_that_changes_the_runs_seed_and_takes_options_knowingly(first_run, capsys, tmp_path):
    given = tmp_path / "other.yaml"
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = 7
    given.write_text(yaml.safe_dump(config))
    ckpt = str(first_run / "checkpoints" / "last.ckpt")
    err = refused(capsys, main, ["eval", "--config", str(given), "--ckpt", ckpt, "--samples", "0"])
    assert f"error: --config {given} differs from the config of the run that wrote {ckpt}" in err
    assert "seed_everything: 0 → 7" in err
    main(["eval", "--ckpt", ckpt, "--samples", "0", "--seed_everything", "7", "--output", str(tmp_path / "x.json")])
    assert "eval: the run's settings overridden by options: seed_everything: 0 → 7" in capsys.readouterr().out


def test_a_run_of_an_earlier_version_resumes_when_a_setting_added_since_keeps_its_default(tmp_path, capsys):
    """A run saved before a setting existed ran as that setting's default does: resuming it with the default is the
    same run; with another value it is refused, naming the setting. (Before: every setting added in a release made
    every earlier run un-resumable: "model.validation.print_completions: (unset) → False".)"""
    root = tmp_path / "old"
    fit(root, steps=1)
    saved = run_dir.saved_config_path(root)
    config = yaml.safe_load(saved.read_text())
    del config["model"]["validation"]["print_completions"]  # as written by the version before the setting
    saved.write_text(yaml.safe_dump(config))
    fit(root, "--ckpt_path", "last", steps=2)
    assert rl_step(root / "checkpoints" / "last.ckpt") == 2
    err = refused(
        capsys,
        fit,
        root,
        "--ckpt_path",
        "last",
        "--model.validation.print_completions",
        "true",
        "--trainer.max_steps",
        "3",
    )
    assert "model.validation.print_completions: False → True" in err
