"""The Python API: ``from lit_gspo import RLModule, PromptDataModule, GSPO, ...`` and ``examples/python_api.py``
with a plain ``lightning.Trainer``."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import lit_gspo

ROOT = Path(__file__).resolve().parents[1]
API = [
    "RLModule",
    "PromptDataModule",
    "RowBatches",
    "RLProgressBar",
    "Generation",
    "Update",
    "WarmStart",
    "LoRA",
    "Objective",
    "PPO",
    "GRPO",
    "DAPO",
    "GSPO",
    "GSPOToken",
    "DrGRPO",
    "CISPO",
    "GMPO",
    "SAPO",
    "DPPO",
    "ClipCov",
    "KLCov",
    "VESPO",
    "LUSPO",
    "HFGenerate",
    "LeanSampler",
    "StaticCacheSampler",
    "RolloutEngine",
    "SingleTurn",
    "Environment",
    "GroupNormalized",
    "RLOO",
    "GAE",
    "RewardSet",
    "CharAccuracy",
    "ExactMatch",
    "AnswerMatch",
]


def test_import_lit_gspo_is_light_and_every_name_of_the_api_resolves():
    code = (
        "import sys, lit_gspo\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('lightning', 'pytorch_lightning', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"`import lit_gspo` pulled in {out}"
    assert set(API) <= set(lit_gspo.__all__) and set(API) <= set(dir(lit_gspo))
    from lit_gspo.lightning.datamodule import PromptDataModule
    from lit_gspo.lightning.module import RLModule
    from lit_gspo.rl.objectives import GSPO

    assert (lit_gspo.RLModule, lit_gspo.PromptDataModule, lit_gspo.GSPO) == (RLModule, PromptDataModule, GSPO)
    for name in API:
        assert getattr(lit_gspo, name).__name__ == name


def test_the_python_api_example_trains_with_a_plain_trainer_and_logs_every_rl_step(tmp_path):
    spec = importlib.util.spec_from_file_location("python_api", ROOT / "examples/python_api.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # the example sets log_every_n_steps=1 (Lightning's default 50 would log no train/* row in 3 steps)
    val = example.main(max_steps=3, root=str(tmp_path), prompts=4, completions=4, warm_start_steps=0, num_val=8)
    assert 0 <= val["val/reward"] <= 1
    with open(sorted(tmp_path.glob("**/metrics.csv"))[-1]) as f:
        rows = list(csv.DictReader(f))
    train_steps = [int(r["step"]) for r in rows if r.get("train/reward")]
    assert len(train_steps) == 3 and len(set(train_steps)) == 3
    val_rows = [r for r in rows if r.get("val/reward")]
    assert float(val_rows[-1]["val/reward"]) == val["val/reward"]
    assert (tmp_path / "hf_model" / "config.json").exists()
