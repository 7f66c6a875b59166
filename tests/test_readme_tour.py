"""The README's tour, as written, top to bottom (issue 29, finding 5).

Before: its DAPO line wrote into ``runs/quickstart`` and replaced the quickstart's ``hf_model/``; the resume line
then resumed DAPO's ``last-v1.ckpt`` with the quickstart's seed and failed after a 30-frame traceback (rewriting
DAPO's ``config.yaml``), and ``eval --ckpt runs/quickstart/hf_model`` scored DAPO's policy with another seed's
held-out prompts. The commands are read from README.md by ``benchmarks/readme_tour.py``; fits run with few steps.
"""

import csv
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from lit_gspo.tools.main import main

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _tour_module():
    spec = importlib.util.spec_from_file_location("readme_tour", ROOT / "benchmarks" / "readme_tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tour = _tour_module()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rl_step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["rl_step"]


def run(argv, capsys) -> str:
    try:
        main(tour.tiny(argv, STEPS))
    except SystemExit as exit_info:  # --print_config exits 0 after printing
        assert exit_info.code in (0, None), capsys.readouterr()
    out, err = capsys.readouterr()
    return out + err


def test_the_tour_commands_are_the_readmes():
    commands = tour.tour_commands((ROOT / "README.md").read_text())
    fits = [c for c in commands if c[0] == "fit"]
    assert fits[0] == ["fit", "--config", "configs/quickstart.yaml"]  # the main job of the install line
    assert ["fit", "--config", "configs/quickstart.yaml", "--model.objective", "DAPO", "--seed_everything", "1"] in fits
    assert ["fit", "--config", "configs/quickstart.yaml", "--ckpt_path", "last"] in fits
    assert [c[:3] for c in commands if c[0] == "eval"] == [
        ["eval", "--ckpt", "runs/quickstart/hf_model"],
        ["eval", "--ckpt", "runs/quickstart/checkpoints/last.ckpt"],
    ]
    assert tour.tiny(fits[0], 4)[-2:] == ["--trainer.max_steps", "4"]
    assert tour.tiny(["fit", "--ckpt_path", "last"], 4)[-2:] == ["--trainer.max_steps", "8"]  # a resume continues


@pytest.mark.slow
def test_the_readme_tour_runs_top_to_bottom_without_one_run_overwriting_another(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tour.prepare(tmp_path)
    quickstart = tmp_path / "runs" / "quickstart"
    outputs = {}
    hf_after_quickstart = None
    for argv in tour.tour_commands((ROOT / "README.md").read_text()):
        text = run(argv, capsys)
        outputs[" ".join(argv)] = text
        if argv == ["fit", "--config", "configs/quickstart.yaml"]:
            hf_after_quickstart = sha256(quickstart / "hf_model" / "model.safetensors")
            ckpt_after_quickstart = sha256(quickstart / "checkpoints" / "last.ckpt")
        if "DAPO" in argv:
            # the DAPO line did not touch the quickstart's run: same export, same checkpoint, its own directory
            assert sha256(quickstart / "hf_model" / "model.safetensors") == hf_after_quickstart
            assert sha256(quickstart / "checkpoints" / "last.ckpt") == ckpt_after_quickstart
            assert (
                "fit: runs/quickstart holds a run with other settings (model.objective.class_path: "
                "lit_gspo.rl.objectives.GSPO → lit_gspo.DAPO, seed_everything: 0 → 1); this run writes to "
                "runs/quickstart-2"
            ) in text
            dapo = tmp_path / "runs" / "quickstart-2"
            saved = yaml.safe_load((dapo / "run_config.yaml").read_text())
            assert saved["seed_everything"] == 1 and saved["model"]["objective"]["class_path"].endswith("DAPO")
            assert rl_step(dapo / "checkpoints" / "last.ckpt") == STEPS
            assert (dapo / "hf_model" / "model.safetensors").is_file()
            assert list((dapo / "checkpoints").glob("*.ckpt")) == [dapo / "checkpoints" / "last.ckpt"]
        if "--ckpt_path" in argv:
            # the resume resumed the quickstart run (seed 0, GSPO) and continued it: every step once, in one file
            assert "fit:" not in text  # resumed where it was asked, no other directory
            assert rl_step(quickstart / "checkpoints" / "last.ckpt") == 2 * STEPS
            assert list((quickstart / "checkpoints").glob("*.ckpt")) == [quickstart / "checkpoints" / "last.ckpt"]
            (metrics,) = quickstart.glob("lightning_logs/version_*/metrics.csv")
            with open(metrics) as f:
                steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")]
            assert steps == list(range(2 * STEPS))
            assert (
                rl_step(tmp_path / "runs" / "quickstart-2" / "checkpoints" / "last.ckpt") == STEPS
            )  # DAPO's as it was
    # eval of runs/quickstart/hf_model: the quickstart's model, with the quickstart's own config, and says which
    text = outputs["eval --ckpt runs/quickstart/hf_model"]
    assert (
        "eval: reading the run's config: runs/quickstart/hf_model/lit_gspo_config.yaml (saved with the model)" in text
    )
    scored = json.loads((quickstart / "hf_model.eval.json").read_text())
    assert scored["seed"] == 0 and scored["rewards"] == ["char_accuracy"] and scored["prompts"] == 8
    with open(next(quickstart.glob("lightning_logs/version_*/metrics.csv"))) as f:
        last_val = [float(r["val/reward"]) for r in csv.DictReader(f) if r.get("val/reward")][-1]
    assert scored["greedy"]["reward"] == pytest.approx(last_val, abs=1e-6)  # the run's own final val/reward
    # eval of the checkpoint on the user's file: the config stored in the checkpoint, the file as an override
    text = next(v for k, v in outputs.items() if "last.ckpt" in k)
    assert "eval: reading the run's config: runs/quickstart/checkpoints/last.ckpt (stored in the checkpoint)" in text
    assert "data.val_source: null → test.jsonl" in text
    scored = json.loads((quickstart / "checkpoints" / "last.eval.json").read_text())
    assert scored["prompts"] == 6 and scored["data"] == "test.jsonl" and scored["seed"] == 0
