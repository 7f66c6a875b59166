"""Every YAML in configs/ parses against the real signatures (litgpt style): a renamed argument breaks a test."""

from pathlib import Path

import pytest
import yaml

from lit_gspo.lightning.cli import RLCLI
from lit_gspo.lightning.datamodule import PromptDataModule
from lit_gspo.lightning.module import RLModule
from lit_gspo.tools.ablate import fit_args, load_ablation

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"


class ParseOnlyCLI(RLCLI):
    """Parses and type-checks a config without building models (the SmolLM2 ones would load 135M weights)."""

    def instantiate_classes(self) -> None:
        pass


def parse(*configs: Path, extra: tuple[str, ...] = ()):
    args = [a for c in configs for a in ("--config", str(c))] + list(extra)
    return ParseOnlyCLI(RLModule, PromptDataModule, args=args, run=False).config


def fit_configs():
    return sorted(
        p for p in CONFIGS.rglob("*.yaml") if p.parent.name not in ("ablate", "objectives", "mismatch", "engines")
    )


@pytest.mark.parametrize("path", fit_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_fit_config_parses(path):
    config = parse(path)
    assert config.trainer.max_steps > 0


@pytest.mark.parametrize("path", sorted((CONFIGS / "objectives").glob("*.yaml")), ids=lambda p: p.stem)
def test_objective_overlay_swaps_only_the_objective(path):
    from lit_gspo.rl.objectives import OBJECTIVES

    config, base = parse(QUICKSTART, path), parse(QUICKSTART)
    assert config.model.objective.class_path.rsplit(".", 1)[-1] == OBJECTIVES[path.stem].__name__
    assert config.data == base.data and config.model.rewards == base.model.rewards


@pytest.mark.parametrize("value", ["GSPOO", "lit_gspo.rl.objectives.GSPOO"])
def test_unknown_objective_error_lists_the_known_ones(value, capsys):
    from lit_gspo.rl.objectives import OBJECTIVES

    with pytest.raises(SystemExit):
        parse(QUICKSTART, extra=("--model.objective", value))
    err = capsys.readouterr().err
    assert value in err and "Known objectives:" in err
    assert all(cls.__name__ in err for cls in OBJECTIVES.values())


def test_the_vllm_overlay_picks_the_vllm_engine_and_a_model_with_head_size_32():
    """Parsed only (vLLM need not be installed): the engine by class path, and by class name on the command line."""
    config = parse(QUICKSTART, CONFIGS / "engines/vllm.yaml")
    assert config.model.engine.class_path.endswith(".VLLMEngine")
    model_config = config.model.policy.config
    assert model_config["hidden_size"] // model_config["num_attention_heads"] == 32
    by_name = parse(QUICKSTART, extra=("--model.engine", "VLLMEngine"))
    assert by_name.model.engine.class_path.rsplit(".", 1)[-1] == "VLLMEngine"


def test_objective_by_class_name_still_parses():
    assert parse(QUICKSTART, extra=("--model.objective", "GRPO")).model.objective.class_path.endswith(".GRPO")


def test_every_registered_objective_has_an_overlay():
    from lit_gspo.rl.objectives import OBJECTIVES

    assert {p.stem for p in (CONFIGS / "objectives").glob("*.yaml")} == set(OBJECTIVES)


def value_at(config, dotted: str):
    """``config[dotted]``, looking through a class's ``init_args`` (``model.objective.clip_high``) as the CLI does."""
    node = config
    for key in dotted.split("."):
        if key not in node and "init_args" in node:
            node = node.init_args
        node = node[key]
    return node


def assert_given(config, key: str, value, arm: str) -> None:
    """The parsed ``config`` holds ``value`` at ``key``; a mapping (``model.update.mismatch: {...}``, a class with its
    ``init_args``) field by field."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert_given(config, f"{key}.{k}", v, arm)
    else:
        assert value_at(config, key) == value, (arm, key)


@pytest.mark.parametrize("path", sorted((CONFIGS / "ablate").glob("*.yaml")), ids=lambda p: p.stem)
def test_ablation_config_loads_and_its_arms_parse(path, tmp_path, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # an ablation's base path is relative to the repository
    ablation = load_ablation(path)
    assert ablation.arms and ablation.seeds and ablation.seed_keys
    base = Path(ablation.base) if isinstance(ablation.base, str) else tmp_path / "base.yaml"
    if isinstance(ablation.base, dict):
        base.write_text(yaml.safe_dump(ablation.base))
    base_objective = parse(base).model.objective.class_path
    for seed in dict.fromkeys((ablation.seeds[0], ablation.seeds[-1])):  # every arm; the seeds differ only in seed_keys
        for arm in ablation.arms:
            args = fit_args(ablation, arm, seed, tmp_path / arm.name, base)
            config = ParseOnlyCLI(RLModule, PromptDataModule, args=args, run=False).config
            objective = arm.objective or arm.overrides.get("model.objective", {}).get("class_path") or base_objective
            assert config.model.objective.class_path.rsplit(".", 1)[-1] == objective.rsplit(".", 1)[-1], (arm, seed)
            for key, value in {**ablation.overrides, **arm.overrides}.items():
                assert_given(config, key, value, arm.name)
            assert all(value_at(config, key) == seed for key in ablation.seed_keys)


@pytest.mark.parametrize("path", sorted((CONFIGS / "mismatch").glob("*.yaml")), ids=lambda p: p.stem)
def test_mismatch_overlay_adds_only_the_correction(path):
    config, base = parse(QUICKSTART, path), parse(QUICKSTART)
    assert config.model["update"].mismatch is not None and base.model["update"].mismatch is None
    assert config.data == base.data and config.model.objective == base.model.objective
