"""docs/from_trl.md against the installed TRL and lit_gspo's own options.

The table must have one row per field ``trl.GRPOConfig`` adds to ``transformers.TrainingArguments``, in TRL's order
(a TRL upgrade that adds a field fails here until the table says what it maps to), and every lit_gspo option it names
(``--model.*``, ``--trainer.*``, ``--data.*``, the top-level ones) must be one the CLI accepts. Its second table, the
TrainingArguments a GRPO run sets most, likewise. The tables the CLI's errors quote (``lit_gspo/lightning/foreign_names.py``)
must say what the doc says, row by row.
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

from transformers import GenerationConfig, TrainingArguments

from lit_gspo.lightning.foreign_names import (
    ALWAYS_ON,
    GENERATION_CONFIG,
    NOT_SUPPORTED,
    TABLES,
    TRAINING_ARGUMENTS,
)
from lit_gspo.lightning.unknown_option import class_settings

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "from_trl.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
OPTION = re.compile(
    r"--(?:model|trainer|data)\.[A-Za-z0-9_.]*[A-Za-z0-9_]|--(?:seed_everything|checkpoint_every_n_steps|ckpt_path|"
    r"push_to_hub|hub_private)\b"
)


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


def sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """The table rows under each ``## heading`` of the doc."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {heading.strip(): table_rows(body) for heading, body in zip(parts[1::2], parts[2::2])}


@pytest.fixture(scope="module")
def doc_sections() -> dict[str, list[tuple[str, str]]]:
    found = sections(DOC.read_text())
    assert list(found) == list(TABLES), f"{DOC}'s sections are not the tables of foreign_names.py, in order"
    assert all(found.values()), f"{DOC} has a section without rows of the form | `field` | ... |"
    return found


@pytest.fixture(scope="module")
def doc_rows(doc_sections) -> list[tuple[str, str]]:
    """The GRPOConfig table's rows."""
    return doc_sections["TRL's GRPOConfig"]


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
    classes = class_settings().get(parent, [])
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


def test_every_option_the_tables_name_exists(doc_sections, cli_keys):
    rows = [row for section in doc_sections.values() for row in section]
    named = {option: field for field, cell in rows for option in named_options(cell)}
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


def leading(cell: str) -> str:
    """What a cell says first: its first backticked span (an option, with a value if it has one), or its opening
    words (``**not supported**``, ``always on``)."""
    cell = cell.strip()
    return cell.split("`")[1] if cell.startswith("`") else cell.replace("**", "")


def says_the_same(pointer: str, cell: str) -> bool:
    """Whether the CLI's pointer (``--model.objective.beta``, ``not supported``, ...) is what the doc's cell says."""
    if pointer == NOT_SUPPORTED:
        return leading(cell).startswith(NOT_SUPPORTED)
    if pointer == ALWAYS_ON:
        return leading(cell).startswith(("always on", "always, in effect"))
    return pointer in named_options(cell) or any(pointer in span for span in re.findall(r"`([^`]+)`", cell))


def test_the_clis_tables_are_the_docs_row_by_row(doc_sections):
    for whose, table in TABLES.items():
        rows = doc_sections[whose]
        assert list(table) == [name for name, _ in rows], f"docs/from_trl.md's {whose} rows are not foreign_names.py's"
        differ = [f"{name}: {table[name]!r}" for name, cell in rows if not says_the_same(table[name], cell)]
        assert not differ, f"foreign_names.py says otherwise than docs/from_trl.md's {whose} for {differ}"
        # outside GRPOConfig's table (TRL's own wording), the row leads with the option the error names
        if whose != "TRL's GRPOConfig":
            led = [
                name
                for name, cell in rows
                if table[name].startswith("--") and not leading(cell).startswith(table[name])
            ]
            assert not led, f"docs/from_trl.md's {whose} rows {led} do not lead with the option the error names"


def test_the_names_are_the_libraries_fields():
    training_arguments = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert [name for name in TRAINING_ARGUMENTS if name not in training_arguments] == []
    generation_config = GenerationConfig().to_dict()
    assert [name for name in GENERATION_CONFIG if name not in generation_config] == []


def test_the_row_check_can_fail():
    assert says_the_same("--model.objective.beta", "`--model.objective.beta` (every objective)")
    assert not says_the_same("--model.objective.beta", "`--model.objective.clip_low`")
    assert says_the_same(NOT_SUPPORTED, "**not supported**: no vLLM server mode")
    assert not says_the_same(NOT_SUPPORTED, "`--model.engine VLLMEngine`")
    assert not says_the_same(ALWAYS_ON, "**not supported**: no")
