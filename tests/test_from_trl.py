"""docs/from_trl.md against the installed TRL and lit_gspo's own options.

The table must have one row per field ``trl.GRPOConfig`` adds to ``transformers.TrainingArguments``, in TRL's order
(a TRL upgrade that adds a field fails here until the table says what it maps to), and every lit_gspo option it names
(``--model.*``, ``--trainer.*``, ``--data.*``) must be one the CLI accepts.
"""

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

trl = pytest.importorskip("trl")

from transformers import TrainingArguments

from lit_gspo.rl import advantages, envs, objectives
from lit_gspo.rl.config import ReferenceSync
from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine
from lit_gspo.rl.learn.mismatch import MIS, OPSM, TIS, Mismatch, SequenceMIS, SequenceTIS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "from_trl.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
OPTION = re.compile(r"--(?:model|trainer|data)\.[A-Za-z0-9_.]*[A-Za-z0-9_]")

#: where an option may name a setting of a class the quickstart config does not instantiate (its ``init_args``):
#: the classes whose ``__init__`` parameters count as settings there
CLASSES_UNDER = {
    "model.objective": [
        objectives.GRPO,
        objectives.DAPO,
        objectives.DrGRPO,
        objectives.GSPO,
        objectives.GSPOToken,
        objectives.LUSPO,
        objectives.CISPO,
        objectives.SAPO,
        objectives.VESPO,
        objectives.GMPO,
        objectives.PPO,
        objectives.ClipCov,
        objectives.KLCov,
        objectives.DPPO,
    ],
    "model.advantage": [
        advantages.GroupNormalized,
        advantages.GroupMean,
        advantages.BatchNormalized,
        advantages.RLOO,
        advantages.GAE,
        advantages.TurnGroupNormalized,
    ],
    "model.update.mismatch": [Mismatch, TIS, SequenceTIS, MIS, SequenceMIS, OPSM],
    "model.engine": [HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine],
    "model.environment": [envs.Environment, envs.SingleTurn, envs.ToolUse, envs.RetryWithFeedback],
    "model.policy.ref_sync": [ReferenceSync],  # null in the quickstart
}


def own_fields() -> list[str]:
    """The fields GRPOConfig adds to TrainingArguments, in dataclasses.fields order."""
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in inherited]


def table_rows(text: str) -> list[tuple[str, str]]:
    """(first-column field name, second cell) of every body row of the doc's table."""
    return [(m.group(1), m.group(2)) for line in text.splitlines() if (m := ROW.match(line.strip()))]


def named_options(cell: str) -> list[str]:
    """The ``--model.``/``--trainer.``/``--data.`` options in a cell's backticked spans, without their values."""
    return [option for span in re.findall(r"`([^`]+)`", cell) for option in OPTION.findall(span)]


def without_init_args(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != "init_args")


def flat_keys(node, prefix: str = "") -> set[str]:
    """Every dotted key of a ``--print_config`` tree (inner nodes too), ``init_args`` levels dropped."""
    keys = set()
    if isinstance(node, dict):
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            keys.add(without_init_args(key))
            keys |= flat_keys(value, key)
    return keys


@pytest.fixture(scope="module")
def doc_rows() -> list[tuple[str, str]]:
    rows = table_rows(DOC.read_text())
    assert rows, f"{DOC} has no table rows of the form | `field` | ... |"
    return rows


@pytest.fixture(scope="module")
def cli_keys() -> set[str]:
    """The option tree of ``lit-gspo fit --config configs/quickstart.yaml --print_config``, flattened."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "lit_gspo", "fit", "--config", "configs/quickstart.yaml", "--print_config"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-3000:]}"
    return flat_keys(yaml.safe_load(done.stdout))


def accepted(option: str, keys: set[str]) -> bool:
    """Whether ``option`` (``--model.objective.clip_high``) is in the printed tree, or a setting of a class that may
    be configured under its parent (``--model.engine.init_args.kv_cache_gb``: a VLLMEngine argument)."""
    key = without_init_args(option.removeprefix("--"))
    if key in keys:
        return True
    parent, _, name = key.rpartition(".")
    classes = CLASSES_UNDER.get(parent, [])
    return any(name in inspect.signature(cls.__init__).parameters for cls in classes)


def test_the_table_lists_exactly_grpo_configs_own_fields_in_order(doc_rows):
    expected, listed = own_fields(), [name for name, _ in doc_rows]
    missing = [name for name in expected if name not in listed]
    extra = [name for name in listed if name not in expected]
    duplicated = sorted({name for name in listed if listed.count(name) > 1})
    assert not (missing or extra or duplicated), (
        f"docs/from_trl.md against trl {trl.__version__}'s GRPOConfig: missing rows {missing}, extra rows {extra}, "
        f"duplicated rows {duplicated}"
    )
    assert listed == expected, (
        f"docs/from_trl.md's rows are not in GRPOConfig's field order; expected {expected}, got {listed}"
    )


def test_every_row_maps_or_says_not_supported(doc_rows):
    empty = [name for name, cell in doc_rows if not cell.strip()]
    assert not empty, f"docs/from_trl.md rows with an empty lit_gspo cell: {empty}"


def test_every_option_the_table_names_exists(doc_rows, cli_keys):
    named = {option: field for field, cell in doc_rows for option in named_options(cell)}
    assert named, "docs/from_trl.md names no --model./--trainer./--data. options"
    unknown = sorted(f"{option} (row {field})" for option, field in named.items() if not accepted(option, cli_keys))
    assert not unknown, f"docs/from_trl.md names options lit-gspo does not have: {unknown}"


def test_the_option_check_can_fail(cli_keys):
    assert accepted("--model.objective.clip_high", cli_keys)
    assert accepted("--model.engine.init_args.kv_cache_gb", cli_keys)
    assert accepted("--model.generation.num_generations", cli_keys)
    assert not accepted("--model.generation.typical_p", cli_keys)
    assert not accepted("--model.engine.init_args.gpu_memory_utilization", cli_keys)
    assert not accepted("--trainer.no_such_flag", cli_keys)
    assert named_options("`--model.objective GSPO --model.objective.clip_high=4e-4`") == [
        "--model.objective",
        "--model.objective.clip_high",
    ]
