"""A class given after a config's class starts from its own defaults, not the replaced class's settings."""

from pathlib import Path

import yaml

from lit_gspo.lightning.class_switch import drop_replaced_init_args
from lit_gspo.lightning.cli import _config_tree, cli_main

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.policy.warm_start.steps", "0"]


def printed_config(tmp_path, **objective_args) -> str:
    """A config as --print_config writes it: GSPO's every setting spelled out."""
    path = tmp_path / "printed.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "objective": {
                        "class_path": "lit_gspo.rl.objectives.GSPO",
                        "init_args": {
                            "clip_low": 3e-4,
                            "clip_high": 4e-4,
                            "beta": 0.0,
                            "kl_estimator": "k3",
                            "aggregation": "seq-mean-token-mean",
                            **objective_args,
                        },
                    },
                    "engine": {
                        "class_path": "lit_gspo.rl.engines.LeanSampler",
                        "init_args": {"attn_implementation": "eager"},
                    },
                }
            }
        )
    )
    return str(path)


def objective_of(tmp_path, *args):
    cli = cli_main([*QUICK, *args, "--trainer.default_root_dir", str(tmp_path / "run")], run=False)
    return cli.model.objective, cli.model.collector.engine


def test_a_class_on_the_command_line_does_not_inherit_the_configs_settings_of_another_class(tmp_path):
    dapo, _ = objective_of(tmp_path, "--config", printed_config(tmp_path), "--model.objective", "DAPO")
    assert type(dapo).__name__ == "DAPO"
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token-mean")  # DAPO's, not GSPO's


def test_settings_given_on_the_command_line_stay_before_or_after_the_class(tmp_path):
    config = printed_config(tmp_path)
    after, _ = objective_of(
        tmp_path, "--config", config, "--model.objective", "DAPO", "--model.objective.clip_high", "0.3"
    )
    before, _ = objective_of(
        tmp_path, "--config", config, "--model.objective.clip_high", "0.3", "--model.objective", "DAPO"
    )
    assert after.clip_high == before.clip_high == 0.3 and after.clip_low == before.clip_low == 0.2


def test_the_same_class_keeps_the_configs_settings(tmp_path):
    gspo, _ = objective_of(tmp_path, "--config", printed_config(tmp_path, clip_high=5e-4), "--model.objective", "GSPO")
    assert gspo.clip_high == 5e-4


def test_a_later_config_and_another_class_setting_are_the_same_mechanism(tmp_path):
    later = tmp_path / "dapo.yaml"
    later.write_text("model:\n  objective: DAPO\n  engine: HFGenerate\n")
    dapo, engine = objective_of(tmp_path, "--config", printed_config(tmp_path), "--config", str(later))
    assert dapo.clip_high == 0.28 and type(engine).__name__ == "HFGenerate" and engine.attn_implementation is None


def test_only_the_replaced_settings_init_args_leave_the_config(tmp_path):
    config = printed_config(tmp_path)
    args, notes = drop_replaced_init_args([f"--config={config}", "--model.objective", "DAPO"], _config_tree)
    kept = yaml.safe_load(args[0].partition("=")[2])["model"]
    assert "init_args" not in kept["objective"] and kept["engine"]["init_args"] == {"attn_implementation": "eager"}
    assert len(notes) == 1 and "DAPO replaces GSPO" in notes[0]
    assert drop_replaced_init_args(["--config", config], _config_tree) == (["--config", config], [])
