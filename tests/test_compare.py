"""``lit-gspo compare`` and the rollout files it replays: identities that hold exactly in this codebase."""

import json

import pytest
import torch

from lit_gspo.models import load_policy
from lit_gspo.rl.advantages import get_advantage
from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.objectives import GRPO
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.rl.rollout_io import load_rollout, policy_dir, save_optimizer_state, save_rollout
from lit_gspo.tools.compare import make_parser
from lit_gspo.tools.compare_replay import run_compare
from lit_gspo.tools.main import main

G = 4


def make_rollout(policy, seed: int = 0) -> RolloutBatch:
    """4 prompts × G = 4 completions of varied lengths; prompt 3's rewards are all equal (Â = 0 there)."""
    gen = torch.Generator().manual_seed(seed)
    N, P, T = 16, 5, 7
    input_ids = torch.randint(3, 30, (N, P + T), generator=gen)
    input_ids[:, :P] = input_ids[::G, :P].repeat_interleave(G, 0)  # a group shares its prompt
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    completion_mask = torch.arange(T) < lengths[:, None]
    attention_mask = torch.cat([torch.ones(N, P, dtype=torch.long), completion_mask.long()], 1)
    rewards = torch.rand(N, generator=gen)
    rewards[3 * G :] = 0.5
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_length=P,
        completion_mask=completion_mask,
        rewards=rewards,
        engine_logprobs=-torch.rand(N, T, generator=gen),
        turn_ids=torch.zeros(N, T, dtype=torch.long),
    )
    batch.advantages = get_advantage("group")(batch, G)
    batch.old_logprobs = Learner(policy, GRPO(), Update()).old_logprobs(batch, torch.arange(N))
    return batch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A rollout file with its policy (Hugging Face format) beside it, as a fit writes them."""
    policy, tokenizer = load_policy(
        "tiny-llama", config_overrides={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}, seed=0
    )
    batch = make_rollout(policy)
    path = tmp_path_factory.mktemp("run") / "rollouts" / "step_3.pt"
    meta = {
        "temperature": 1.0,
        "max_len": 7,
        "group_size": G,
        "update": {"micro_batch_size": 6},
        "optimizer": "AdamW",
        "optimizer_hparams": {"lr": 1e-2},
        "model": "tiny-llama",
    }
    save_rollout(path, batch, step=3, meta=meta)
    policy.save_pretrained(policy_dir(path))
    tokenizer.save_pretrained(policy_dir(path))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)  # a run's optimiser state: Adam's moments after a step
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    policy.zero_grad()
    save_optimizer_state(policy_dir(path), opt.state_dict())
    return path, batch


def test_a_saved_rollout_round_trips_bit_exactly(saved):
    path, batch = saved
    loaded, payload = load_rollout(path)
    assert payload["step"] == 3 and loaded.prompt_length == batch.prompt_length and loaded.routing is None
    for name in (
        "input_ids",
        "attention_mask",
        "completion_mask",
        "rewards",
        "advantages",
        "engine_logprobs",
        "old_logprobs",
        "turn_ids",
    ):
        a, b = getattr(loaded, name), getattr(batch, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert loaded.ref_logprobs is None
    plain = torch.load(path, weights_only=True)  # tensors and plain data only
    assert set(plain["tensors"]) >= {"input_ids", "advantages", "old_logprobs"}


def test_a_changed_rollout_file_is_refused(saved, tmp_path):
    path, _ = saved
    copy = tmp_path / "step_3.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    (tmp_path / "step_3.pt.sha256").write_text(path.with_name("step_3.pt.sha256").read_text())
    with pytest.raises(Exception, match="does not match its hash"):
        load_rollout(copy)


@pytest.fixture(scope="module")
def report(saved, tmp_path_factory):
    path, _ = saved
    specs = [
        "gspo",
        "gspo_token",
        "grpo",
        "grpo:aggregation=token-mean",
        "dapo",
        "dr_grpo",
        "cispo",
        "sapo",
        "gspo:clip_low=0.0003",
    ]  # the last one: gspo again, under another label
    return run_compare(str(path), objectives=specs, minibatch_steps=2, out=str(tmp_path_factory.mktemp("out")))


def cos(report, a, b):
    m = report["cosine_on_policy"]
    return m["matrix"][m["labels"].index(a)][m["labels"].index(b)]


def test_the_replay_starts_from_the_weights_and_optimiser_state_that_sampled_the_rollout(report):
    assert report["weights_gap"] < 1e-5
    assert report["settings"]["optimizer_state"] and report["settings"]["optimizer_hparams"]["lr"] == 1e-2


def test_on_policy_identities(report):
    on = {k: v["on_policy"] for k, v in report["objectives"].items()}
    # DAPO and GRPO with token-mean aggregation: the same gradient on-policy (the ratio is 1: no clipping)
    assert cos(report, "grpo:aggregation=token-mean", "dapo") == pytest.approx(1, abs=1e-6)
    assert on["grpo:aggregation=token-mean"]["grad_norm"] == pytest.approx(on["dapo"]["grad_norm"], rel=1e-5)
    # the plain policy gradient (token-mean) is DAPO's, Dr. GRPO's (a constant length) and CISPO's on-policy
    for label in ("dapo", "dr_grpo", "cispo", "grpo:aggregation=token-mean"):
        assert on[label]["cos_pg"] == pytest.approx(1, abs=1e-6), label
    assert on["dapo"]["grad_norm"] == pytest.approx(report["pg"]["grad_norm"], rel=1e-5)
    # ... but not GRPO's seq-mean-token-mean when lengths differ: the identity above is not vacuous
    assert on["grpo"]["cos_pg"] < 1 - 1e-4
    # GSPO on-policy (s_i = 1) is GRPO's seq-mean-token-mean gradient, and SAPO's (gate weight 1 at r = 1)
    for label in ("grpo", "sapo", "gspo_token"):
        assert cos(report, "gspo", label) == pytest.approx(1, abs=1e-6), label
        assert on[label]["grad_norm"] == pytest.approx(on["gspo"]["grad_norm"], rel=1e-5), label
    for label in report["cosine_on_policy"]["labels"]:
        assert cos(report, label, label) == pytest.approx(1, abs=1e-9)
    # on-policy nothing is clipped; every token of a row with Â != 0 carries gradient (3 of 4 groups here)
    assert all(v["clip_frac"] == 0 for v in on.values())
    assert len({v["grad_token_share"] for v in on.values()}) == 1
    assert 0.5 < on["gspo"]["grad_token_share"] < 1


def test_off_policy_identities(report):
    res = report["objectives"]
    # GSPO-token with per-row Â is GSPO in value, clipping and gradient: the same K steps
    for a, b in zip(res["gspo"]["steps"], res["gspo_token"]["steps"]):
        assert a["clip_frac"] == b["clip_frac"] and a["grad_token_share"] == b["grad_token_share"]
        assert a["cos_pg"] == pytest.approx(b["cos_pg"], abs=1e-5)
    assert res["gspo"]["spread"][-1]["seq_logratio_std"] == pytest.approx(
        res["gspo_token"]["spread"][-1]["seq_logratio_std"], rel=1e-4
    )
    # the replay is deterministic: the same objective under two labels gives bit-identical records
    assert res["gspo"]["steps"] == res["gspo:clip_low=0.0003"]["steps"]
    assert res["gspo"]["spread"] == res["gspo:clip_low=0.0003"]["spread"]
    # the first minibatch step is on-policy: DAPO's gradient is the plain PG of the same rows (so the rows match)
    assert res["dapo"]["steps"][0]["cos_pg"] == pytest.approx(1, abs=1e-6)
    assert res["dapo"]["steps"][1]["cos_pg"] < 1 - 1e-6  # and the second is not
    # the weights moved: the ratios are no longer 1; CISPO and SAPO never zero a token's gradient
    assert all(
        r["spread"][0]["seq_logratio_std"] == 0 and r["spread"][-1]["seq_logratio_std"] > 0 for r in res.values()
    )
    assert len(res["gspo"]["steps"]) == 2
    for label in ("cispo", "sapo"):
        assert all(s["clip_frac"] == 0 for s in res[label]["steps"])


def test_the_cli_writes_the_report_json_and_plots(saved, tmp_path, capsys):
    path, _ = saved
    out = tmp_path / "cmp"
    main(
        [
            "compare",
            "--rollout",
            str(path),
            "--objectives",
            "gspo",
            "dapo",
            "--minibatch_steps",
            "2",
            "--num_minibatches",
            "1",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "| gspo |" in printed and f"lit-gspo compare --rollout {path}" in printed
    for name in ("report.md", "compare.json", "gradient_cosine.png", "ratio_spread.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "compare.json").read_text())
    assert data["settings"]["epochs"] == 2 and list(data["objectives"]) == ["gspo", "dapo"]
    assert "lit-gspo compare --rollout" in (out / "report.md").read_text()


def test_without_matplotlib_the_report_and_json_are_written_and_name_the_plot_extra(
    saved, tmp_path, capsys, monkeypatch
):
    import sys

    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "cmp"
    main(
        [
            "compare",
            "--rollout",
            str(saved[0]),
            "--objectives",
            "gspo",
            "grpo",
            "--minibatch_steps",
            "1",
            "--num_minibatches",
            "1",
            "--out",
            str(out),
        ]
    )
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "report.md"]
    report = (out / "report.md").read_text()
    assert "| gspo |" in report and "| grpo |" in report and "![" not in report
    assert "No plots: Plotting a compare report needs the optional package `matplotlib`" in report
    assert "pip install 'lit-gspo[plot]'" in report and "pip install 'lit-gspo[plot]'" in capsys.readouterr().out
    assert list(json.loads((out / "compare.json").read_text())["objectives"]) == ["gspo", "grpo"]


def test_compare_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for action in make_parser()._actions:
        for option in action.option_strings:
            assert option in out
    assert "gspo" in out and "dapo" in out  # the registered objectives are listed


def test_an_unknown_objective_names_the_registered_ones(saved, tmp_path):
    with pytest.raises(ValueError, match="registered"):
        run_compare(str(saved[0]), objectives=["nope"], out=str(tmp_path))
    with pytest.raises(ValueError, match="critic"):
        run_compare(str(saved[0]), objectives=["ppo"], out=str(tmp_path))


def test_a_fit_with_saving_on_writes_the_rollout_and_its_policy(tmp_path):
    from lit_gspo.lightning.cli import cli_main

    root = tmp_path / "run"
    cli = cli_main(
        [
            "--config",
            "configs/quickstart.yaml",
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(root),
            "--model.generation.dump_every_n_steps",
            "2",
            "--model.policy.warm_start.steps",
            "0",
            "--model.validation.every_n_steps",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--data.prompts_per_step",
            "4",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert sorted(p.name for p in (root / "rollouts").glob("*.pt")) == ["step_2.pt"]  # step 0 is never saved
    batch, payload = load_rollout(root / "rollouts" / "step_2.pt")
    assert payload["step"] == 2 and payload["meta"]["group_size"] == 8 and len(batch) == 32
    assert batch.advantages is not None and batch.old_logprobs is not None and batch.ref_logprobs is not None
    assert (policy_dir(root / "rollouts" / "step_2.pt") / "config.json").is_file()
    state = torch.load(policy_dir(root / "rollouts" / "step_2.pt") / "optimizer.pt", weights_only=True)
    assert state["state"]  # AdamW's moments after two steps
