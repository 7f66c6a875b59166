"""Module paths from before the rl/ models/ data/ runtime/ lightning/ tools/ layout keep working (``lit_gspo/moved.py``):
imports in users' scripts and class paths in users' YAML."""

import importlib
import subprocess
import sys

import pytest
import torch
import yaml

from lit_gspo.moved import MOVED, MOVED_NAMES, SPLIT


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module_itself(old):
    module = importlib.import_module(f"lit_gspo.{old}")
    assert module is importlib.import_module(f"lit_gspo.{MOVED[old]}")
    assert module.__name__ == module.__spec__.name == f"lit_gspo.{MOVED[old]}"  # not renamed by the alias


@pytest.mark.parametrize("old", sorted(SPLIT))
def test_a_split_module_resolves_each_name_from_its_new_home(old):
    module = importlib.import_module(f"lit_gspo.{old}")
    for name, home in SPLIT[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(f"lit_gspo.{home}"), name)
    with pytest.raises(AttributeError, match=f"lit_gspo.{old} was split.*where they went"):
        module.no_such_name


def test_old_submodules_and_names_of_packages_that_stayed():
    from lit_gspo.envs.calculator import calculator
    from lit_gspo.objectives.gspo import GSPO
    from lit_gspo.rl.envs.calculator import calculator as new_calculator
    from lit_gspo.rl.objectives import GSPO as NewGSPO

    assert GSPO is NewGSPO and calculator is new_calculator
    for module, names in MOVED_NAMES.items():
        for name, home in names.items():
            assert getattr(importlib.import_module(module), name) is getattr(importlib.import_module(home), name)


def test_a_config_with_old_class_paths_parses_to_the_same_objects(tmp_path):
    """A YAML written before the layout (every class path old) gives the run the new layout's classes."""
    config = {
        "model": {
            "objective": {"class_path": "lit_gspo.objectives.GSPO", "init_args": {"clip_high": 5e-4}},
            "engine": {"class_path": "lit_gspo.engines.LeanSampler"},
            "environment": {"class_path": "lit_gspo.envs.ToolUse",
                            "init_args": {"tools": ["lit_gspo.envs.calculator.calculator"]}},
            "rewards": [{"class_path": "lit_gspo.rewards.CharAccuracy"}],
            "advantage": {"class_path": "lit_gspo.advantages.RLOO"},
            "mismatch": {"corrections": [{"class_path": "lit_gspo.mismatch.TIS", "init_args": {"cap": 2.0}}]},
        },
        "trainer": {"callbacks": [{"class_path": "lit_gspo.progress.RLProgressBar"}]},
    }
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    code = (f"from lit_gspo.tools.main import cli_main\ncli = cli_main(['--config', 'configs/quickstart.yaml', '--config', "
            f"{str(path)!r}, '--trainer.max_steps', '0'], run=False)\nm = cli.model\n"
            "print(type(m.objective).__module__, type(m.collector.engine).__module__, type(m.collector.environment).__module__, "
            "type(m.advantage).__module__, type(m.learner.mismatch.corrections[0]).__module__, m.objective.clip_high)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(_root()))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-6:] == ["lit_gspo.rl.objectives.gspo", "lit_gspo.rl.engines.lean", "lit_gspo.rl.envs.tools",
                                      "lit_gspo.rl.advantages", "lit_gspo.rl.learn.mismatch", "0.0005"]


@pytest.mark.parametrize("module", ["lit_gspo", "lit_gspo.cli", "lit_gspo.tools.main"])
def test_python_dash_m_runs_the_command_by_its_new_and_old_module(module):
    """``torchrun ... -m lit_gspo.cli fit ...`` in a user's launch script keeps working; ``-m lit_gspo`` is the short form."""
    out = subprocess.run([sys.executable, "-m", module, "compare", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: lit-gspo compare --rollout ROLLOUT")


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- settings moved into groups
def test_old_setting_names_on_the_command_line_and_in_config_files_read_as_their_groups(tmp_path, caplog):
    """``--model.val_every_n_steps 5`` and a config file's ``model: {routing_replay: ...}`` (names before the settings were
    grouped) give the grouped settings, with one note naming each rename."""
    from lit_gspo.rl.config import MOVED_SETTINGS
    from lit_gspo.tools.main import cli_main

    old = tmp_path / "old.yaml"
    old.write_text("model:\n  dynamic_sampling: true\n  max_sampling_rounds: 3\n  save_rollouts_every_n_steps: 7\n"
                   "  validation: {num_logged_completions: 2}\n")
    with caplog.at_level("INFO"):
        cli = cli_main(["--config", "configs/quickstart.yaml", "--config", str(old), "--model.val_every_n_steps", "5",
                        "--model.print_completions=true", "--trainer.max_steps", "0"], run=False)
    module = cli.model
    assert (module.validation.every_n_steps, module.validation.print_completions, module.validation.num_logged_completions,
            module.sampling.dynamic, module.sampling.max_rounds, module.rollout_dumps.every_n_steps) == (5, True, 2, True, 3, 7)
    assert module.collector.dynamic_sampling is True and module.collector.max_sampling_rounds == 3
    note = next(r.getMessage() for r in caplog.records if "old names" in r.getMessage())
    for key in ("val_every_n_steps", "print_completions", "dynamic_sampling", "max_sampling_rounds", "save_rollouts_every_n_steps"):
        assert f"model.{key} → model.{MOVED_SETTINGS[key]}" in note


def test_a_run_saved_with_the_old_names_resumes_under_the_new_ones(tmp_path):
    from lit_gspo.lightning import run_dir
    from lit_gspo.tools.main import main

    args = ["fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir", str(tmp_path), "--model.warm_start.steps",
            "0", "--data.num_train", "16", "--data.num_val", "2", "--data.prompts_per_step", "2",
            "--model.generation.num_generations", "2", "--model.generation.max_new_tokens", "2",
            "--trainer.enable_progress_bar", "false", "--model.validation.every_n_steps", "0"]
    main(args + ["--trainer.max_steps", "1"])
    saved = run_dir.saved_config_path(tmp_path)
    config = yaml.safe_load(saved.read_text())
    validation = config["model"].pop("validation")  # as the version before the groups wrote it
    config["model"]["val_every_n_steps"] = validation["every_n_steps"]
    saved.write_text(yaml.safe_dump(config))
    main(args + ["--trainer.max_steps", "2", "--ckpt_path", "last"])  # the same settings: resumed, not refused
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["rl_step"] == 2
