"""Module paths from before the rl/ models/ data/ runtime/ lightning/ tools/ layout keep working (``lit_gspo/moved.py``):
imports in users' scripts and class paths in users' YAML."""

import importlib
import subprocess
import sys

import pytest
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
