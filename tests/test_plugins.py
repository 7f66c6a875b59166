"""A user's objective, reward, environment and engine, in a file outside the package, named by class path."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import column, read_metrics, tiny_args  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_example_plugins_run_a_fit_by_class_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as PYTHONPATH=examples does
    from lit_gspo.tools.main import cli_main

    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "2",
            "--model.validation.every_n_steps",
            "0",
            "--model.objective",
            "plugins.REINFORCE",
            "--model.rewards",
            "[plugins.exact_answer, lit_gspo.rl.rewards.CharAccuracy]",
            "--model.environment",
            "plugins.Prefixed",
            "--model.environment.prefix",
            "rev? ",
            "--model.engine",
            "plugins.CountingEngine",
        ),
        run=False,
    )
    model = cli.model
    assert [type(x).__name__ for x in (model.objective, model.collector.environment, model.collector.engine)] == [
        "REINFORCE",
        "Prefixed",
        "CountingEngine",
    ]
    prompt_ids = model.collector.encode(model.policy, [{"prompt": "rev 123="}])[0]
    assert model.tokenizer.decode(prompt_ids, skip_special_tokens=True).startswith("rev? rev 123=")
    before = [p.detach().clone() for p in model.policy.parameters()]
    cli.trainer.fit(model, datamodule=cli.datamodule)
    engine = model.collector.engine
    # 2 RL steps × 4 prompts, plus the greedy validation before the first step and at the end (8 prompts each)
    assert engine.prompts == 2 * 4 + 2 * 8 and engine.tokens > 0
    rows = read_metrics(tmp_path)
    assert column(rows, "train/rewards/exact_answer/mean") and column(rows, "train/clip_frac") == [0.0, 0.0]
    assert max(column(rows, "train/rows_with_gradient")) > 0  # CharAccuracy's partial credit: groups differ
    assert any(not torch.equal(a, b) for a, b in zip(before, model.policy.parameters()))
