"""`lit-gspo ablate`: the toy config runs every arm × seed, writes summary.csv and report.md, reproducibly."""

import csv
import gc
import json
from pathlib import Path

import pytest
import yaml
from test_own_context import record_trainers

from lit_gspo.tools.ablate import fit_args, load_ablation, main
from lit_gspo.tools.ablate_report import SUMMARY_COLUMNS, paired_by_seed
from lit_gspo.tools.main import main as cli_entry

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs/ablate/toy.yaml"
REQUIRED = {
    "arm",
    "seed",
    "final_val_reward",
    "best_val_reward",
    "steps_to_target",
    "mean_clip_frac",
    "mean_kl",
    "mean_response_length",
    "wall_s",
    "collapsed",
}


def read_summary(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.chdir(ROOT)  # the base config path is relative to the repository
    out = tmp_path_factory.mktemp("toy")
    cli_entry(["ablate", "--config", str(TOY), "--output_dir", str(out / "a")])
    main(["--config", str(TOY), "--output_dir", str(out / "b")])  # same config and seed, again
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_every_ablate_config_parses():
    for path in sorted((ROOT / "configs/ablate").glob("*.yaml")):
        ab = load_ablation(path)
        assert ab.arms and ab.seeds, path
        for arm in ab.arms:  # every override is a dotted fit flag
            assert all("." in k or k == "seed_everything" for k in {**ab.overrides, **arm.overrides}), (path, arm)


@pytest.mark.slow
def test_toy_ablation_writes_summary_and_report(toy_run):
    rows = read_summary(toy_run / "a" / "summary.csv")
    assert list(rows[0]) == SUMMARY_COLUMNS and REQUIRED <= set(rows[0])
    assert [(r["arm"], r["seed"]) for r in rows] == [("GRPO", "0"), ("GSPO-wide", "0")]
    assert all(r["status"] == "ok" and r["num_steps"] == "2" and r["collapsed"] in ("yes", "no") for r in rows), rows
    assert all(0 <= float(r["mean_clip_frac"]) <= 1 and float(r["wall_s"]) > 0 for r in rows)
    assert all(r["mean_seq_logratio_std"] not in ("", "nan") for r in rows)  # off-policy: ratio diagnostics
    report = (toy_run / "a" / "report.md").read_text()
    assert "| GRPO |" in report and "| GSPO-wide |" in report and "val_reward.png" in report
    assert (toy_run / "a" / "val_reward.png").stat().st_size > 1000
    with open(toy_run / "a" / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    for arm in ("GRPO", "GSPO-wide"):  # validated before the first update, as `lit-gspo fit` does, then every step
        assert [int(r["step"]) for r in curves if r["arm"] == arm and r["val/reward"]] == [0, 1, 2], arm


@pytest.mark.slow
def test_same_config_and_seed_give_the_same_summary(toy_run):
    a, b = read_summary(toy_run / "a" / "summary.csv"), read_summary(toy_run / "b" / "summary.csv")
    for ra, rb in zip(a, b):
        ra.pop("wall_s"), rb.pop("wall_s")
        assert ra == rb


def test_a_failing_arm_is_reported_not_fatal(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load(TOY.read_text())
    raw["arms"] = [
        {"name": "broken", "objective": "GRPO", "overrides": {"model.generation.max_new_tokens": 0}},
        raw["arms"][0],
    ]
    raw["overrides"]["trainer.max_steps"] = 1
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    built = record_trainers(monkeypatch)
    main(["--config", str(config), "--output_dir", str(tmp_path / "out")])
    rows = read_summary(tmp_path / "out" / "summary.csv")
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert rows[0]["error"]
    gc.collect()
    assert len(built) == 1 and built[0]() is None  # the ok arm's model went with it (the broken one built none)


def test_fit_args_put_the_objective_before_its_overrides_and_seed_everything(tmp_path):
    ab = load_ablation(TOY)
    args = fit_args(ab, ab.arms[1], 3, tmp_path, Path("base.yaml"))
    assert args.index("--model.objective") < args.index("--model.objective.clip_high")
    for key in ("--seed_everything", "--data.seed"):
        assert args[args.index(key) + 1] == "3"


def test_a_signal_stops_the_whole_ablation_not_just_its_arm(tmp_path, monkeypatch):
    """SIGTERM/SIGINT end a fit with RunInterrupted (checkpoint saved, exit 143/130): ablate must stop there and
    exit with that code, not report the arm as failed and start the next one."""
    import lit_gspo.tools.ablate as ablate
    from lit_gspo.lightning.callbacks.signals import RunInterrupted

    monkeypatch.chdir(ROOT)
    started = []

    def interrupted(args):
        started.append(args)
        raise RunInterrupted(143, "SIGTERM: saved a checkpoint")

    monkeypatch.setattr(ablate, "run_one", interrupted)
    with pytest.raises(RunInterrupted) as stopped:
        main(["--config", str(TOY), "--output_dir", str(tmp_path / "out")])
    assert stopped.value.code == 143 and len(started) == 1  # no further arm or seed was started
    statuses = [json.loads(p.read_text())["status"] for p in (tmp_path / "out").rglob("status.json")]
    assert statuses == ["interrupted"]


def test_arms_are_compared_paired_by_seed_with_standard_errors():
    rows = [
        {"arm": arm, "seed": seed, "status": "ok", "final_val_reward": v}
        for arm, seed, v in [
            ("A", 0, 0.5),
            ("A", 1, 0.25),
            ("A", 2, 0.75),
            ("B", 0, 0.75),
            ("B", 1, 0.25),
            ("B", 2, 0.5),
            ("C", 0, 0.625),
        ]
    ]
    rows.append({"arm": "C", "seed": 1, "status": "failed", "final_val_reward": None})
    lines = paired_by_seed(rows, ["A", "B", "C"])
    assert lines[2] == "| 0 | 0.500 | 0.750 | 0.625 |" and lines[3] == "| 1 | 0.250 | 0.250 | – |"
    # B − A = (+0.25, 0, −0.25): mean 0, s.d. 0.25, s.e. 0.25/√3 = 0.144; C − A: one pair (+0.125), no s.e.
    assert lines[-2] == "| B | 3 | +0.000 ± 0.144 | 1 / 1 / 1 |"
    assert lines[-1] == "| C | 1 | +0.125 ± nan | 1 / 0 / 0 |"
    assert paired_by_seed(rows, ["A"]) == []


METRICS = """step,train/reward,train/loss,val/reward,val/pass@2,val/rewards/f/mean
0,,,0.1,0.2,0.1
1,0.2,0.5,,,
2,0.3,0.4,0.3,0.7,0.3
3,0.4,0.3,,,
4,0.5,0.2,0.6,0.9,0.6
"""


@pytest.mark.parametrize(
    "metric, steps", [("val/reward", 4), ("val/pass@2", 2), ("val/rewards/f/mean", 4), ("train/reward", 4)]
)
def test_steps_to_target_follows_any_logged_metric(metric, steps, tmp_path):
    """A target metric other than val/reward and the plotted train/* curves was read as never reaching the target."""
    from lit_gspo.tools.ablate_report import summarise_run

    (tmp_path / "status.json").write_text(json.dumps({"status": "ok"}))
    (tmp_path / "metrics.csv").write_text(METRICS)
    row, _ = summarise_run(tmp_path, arm="a", seed=0, target=0.5, target_metric=metric)
    assert row["steps_to_target"] == steps and row["target_logged"]
    row, _ = summarise_run(tmp_path, arm="a", seed=0, target=0.5, target_metric="val/pass@4")
    assert row["steps_to_target"] is None and row["target_logged"] is False  # not measured, which the report says


def test_a_target_metric_no_run_logs_is_refused_at_load(tmp_path):
    config = yaml.safe_load(TOY.read_text())
    path = tmp_path / "ab.yaml"
    path.write_text(yaml.safe_dump({**config, "base": str(ROOT / config["base"]), "target_metric": "reward"}))
    with pytest.raises(ValueError, match=r"target_metric 'reward' is never logged: name a val/\* metric"):
        load_ablation(path)
