"""A model that brings its own Python (``auto_map`` in its config.json, TRL's ``trust_remote_code``): refused at start
without ``--model.policy.trust_remote_code true``, never prompted for; with it, its own class trains, and the run's
export and ``lit-gspo eval`` load it again with the same trust (a reward model's: tests/test_reward_model.py)."""

import json
from pathlib import Path

import pytest
import torch
from test_trainer import tiny_args

from lit_gspo.models.loading import load_policy
from lit_gspo.tools import eval as eval_cli
from lit_gspo.tools.main import cli_main, main

CONFIG_CODE = (
    "from transformers import LlamaConfig\n\n\nclass TinyRemoteConfig(LlamaConfig):\n    model_type = 'tiny-remote'\n"
)
MODEL_CODE = """from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_tinyremote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig


class TinyRemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyRemoteConfig

    def __init__(self, config):  # its base built here: transformers' AutoModel does not know this config
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def with_own_code(root: Path, base: str, auto_class: str) -> str:
    """The Llama model saved in ``root`` rewritten as an architecture transformers does not ship: its config and model
    classes (subclasses of LlamaConfig and of ``base``) are the directory's own Python files. Returns its class name."""
    head = base.removeprefix("Llama")
    (root / "configuration_tinyremote.py").write_text(CONFIG_CODE)
    (root / "modeling_tinyremote.py").write_text(MODEL_CODE)
    config = json.loads((root / "config.json").read_text())
    config.update(
        model_type="tiny-remote",
        architectures=[f"TinyRemote{head}"],
        auto_map={
            "AutoConfig": "configuration_tinyremote.TinyRemoteConfig",
            auto_class: f"modeling_tinyremote.TinyRemote{head}",
        },
    )
    (root / "config.json").write_text(json.dumps(config))
    return f"TinyRemote{head}"


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory) -> Path:
    """The quickstart's tiny Llama as a model with its own code."""
    root = tmp_path_factory.mktemp("remote") / "tiny-remote"
    model, tokenizer = load_policy("tiny-llama", config_overrides={"hidden_size": 64, "num_hidden_layers": 2})
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    with_own_code(root, "LlamaForCausalLM", "AutoModelForCausalLM")
    return root


def remote_args(tmp_path, model: Path, *extra: str) -> list[str]:
    return tiny_args(tmp_path, "--model.policy.name", str(model), "--model.policy.config", "null", *extra)


def test_a_model_with_its_own_code_is_refused_in_one_line_without_trust(remote_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)  # transformers would ask on a terminal
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *remote_args(tmp_path, remote_model)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err)
    assert err[-1] == (
        f"error: cannot load policy {str(remote_model)!r}: its config maps it to Python of its own (auto_map), which "
        "runs only with --model.policy.trust_remote_code true (TRL's trust_remote_code; only for a source you trust)"
    )


def test_with_trust_its_own_class_trains_and_its_export_loads_with_its_code(remote_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cli = cli_main(remote_args(tmp_path, remote_model, "--model.policy.trust_remote_code", "true"), run=False)
    assert type(cli.model.policy).__name__ == "TinyRemoteForCausalLM"
    assert type(cli.model.policy).__module__.startswith("transformers_modules.")  # the directory's own code
    before = {k: v.clone() for k, v in cli.model.policy.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    trained = cli.model.policy.state_dict()
    assert any(not torch.equal(before[k], trained[k]) for k in before)

    export = next(tmp_path.glob("**/hf_model"))
    assert {"configuration_tinyremote.py", "modeling_tinyremote.py"} <= {p.name for p in export.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    assert type(loaded).__name__ == "TinyRemoteForCausalLM"
    assert all(torch.equal(loaded.state_dict()[k], v.cpu()) for k, v in trained.items())

    # lit-gspo eval reads the run's settings, trust included, and loads the export with its own code
    result = eval_cli.main(["--ckpt", str(export), "--samples", "0", "--output", str(tmp_path / "eval.json")])
    assert json.loads((tmp_path / "eval.json").read_text())["greedy"]["reward"] == result["greedy"]["reward"]


def test_vllm_is_refused_a_model_type_that_exists_only_in_the_models_own_code(remote_model):
    """vLLM builds the policy from its config.json alone, without the code that defines the type."""
    from lit_gspo.rl.engines.vllm import check_vllm_knows_config

    policy, _ = load_policy(str(remote_model), trust_remote_code=True)
    with pytest.raises(ValueError, match=r"model type 'tiny-remote' exists only in the model's own code \(auto_map\)"):
        check_vllm_knows_config(policy.config)
    check_vllm_knows_config(load_policy("tiny-llama")[0].config)  # a type transformers ships
