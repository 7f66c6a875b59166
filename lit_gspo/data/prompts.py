"""Prompt rows from a built-in task, a local file or directory, or a Hugging Face Hub dataset; prompt encoding."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from lit_gspo.data.synthetic import TASKS, make_split
from lit_gspo.runtime.hub import hub_offline, hub_unreachable, offline_hint
from lit_gspo.runtime.user_errors import option

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
#: split names a user may give for a directory's split → the name ``datasets`` files it under (``val.jsonl`` → "validation")
SPLIT_ALIASES = {
    "val": "validation",
    "valid": "validation",
    "dev": "validation",
    "eval": "test",
    "testing": "test",
    "training": "train",
}


def held_out_split(splits, val_split: str, train_split: str | None = None) -> str | None:
    """Which of ``splits`` (a directory's, a ``DatasetDict``'s) validates: ``val_split`` (or the name ``datasets``
    files it under), else ``validation``, else ``test``; never ``train_split``. None when it has none of them."""
    wanted = SPLIT_ALIASES.get(val_split, val_split)
    return next((s for s in (wanted, "validation", "test") if s in splits and s != train_split), None)


#: what ``_load_dataset`` returns: rows as written (JSON, CSV) or a ``datasets.Dataset`` (Parquet, Hub), and the columns
Table = tuple[object, list[str]]


def read_data_file(path: Path) -> Table:
    """The rows of one local file, every value as the file writes it, and its columns (in first-seen order).

    JSON/JSONL are parsed with Python's ``json`` (a string stays a string: ``"000"`` and ``"2024-01-01"`` are not
    turned into a number or a date, as Arrow's JSON reader would); every CSV cell is text (``000`` stays ``"000"``,
    ``NA`` stays ``"NA"``; only an empty cell is missing: None). A row without some column gets None there.
    Parquet carries its own types and is read by ``datasets``.
    """
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"cannot read {str(path)!r}: unsupported extension {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}"
        )
    if builder == "parquet":
        from datasets import load_dataset

        dataset = load_dataset("parquet", data_files=str(path), split="train")
        return dataset, list(dataset.column_names)
    check_text_file(path)
    records = _read_csv(path) if builder == "csv" else _read_json(path)
    if not records:
        raise ValueError(f"{path} holds no rows: give a file with at least one row")
    return _records_table(records)


def _records_table(records: list[dict]) -> Table:
    """Row dicts and their columns in first-seen order; a row without some column gets None there."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    return [{c: r.get(c) for c in columns} for r in records], columns


def in_memory_table(data, name: str, split: str, split_setting: str = "data.train_split") -> Table:
    """Rows given from Python, as TRL's ``train_dataset``/``eval_dataset`` take them: a ``datasets.Dataset``, a
    ``DatasetDict`` (its ``split``, set by ``split_setting``), a list of row dicts or a pandas ``DataFrame``.
    ``name`` is theirs in messages."""
    if is_dataset_dict(data):
        if split not in data:
            raise ValueError(
                f"{name} has the splits {sorted(data)}, not {option(split_setting, split)}: name one of them there"
            )
        data = data[split]
    if _is_dataset(data):
        return data, list(data.column_names)
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame: a missing cell is None
        data = data.astype(object).where(data.notna(), None).to_dict("records")
    if isinstance(data, (list, tuple)):
        not_rows = [i for i, row in enumerate(data) if not isinstance(row, dict)]
        if not not_rows:
            return _records_table(list(data))
        what = f"a list whose item {not_rows[0]} is a {type(data[not_rows[0]]).__name__}"
    elif isinstance(data, str):
        what = f"the text {data!r} (a task, file or Hub dataset by name is PromptDataModule(train_source=...))"
    else:
        kind = type(data)
        what = f"a {kind.__qualname__ if kind.__module__ == 'builtins' else f'{kind.__module__}.{kind.__qualname__}'}"
        if hasattr(data, "__iter__") and not hasattr(data, "__len__"):
            what += " (a stream: its rows must be counted and shuffled, so load them whole, without streaming=True)"
    raise TypeError(
        f"{name} must be a datasets.Dataset or DatasetDict, a list of row dicts or a pandas DataFrame, got {what}"
    )


def is_dataset_dict(data) -> bool:
    """A ``datasets.DatasetDict``: named splits, each a ``datasets.Dataset``."""
    return isinstance(data, dict) and bool(data) and all(_is_dataset(v) for v in data.values())


def _is_dataset(data) -> bool:
    """A ``datasets.Dataset`` (map-style: sized, with columns and ``select``), read without importing ``datasets``."""
    return hasattr(data, "column_names") and hasattr(data, "select") and hasattr(data, "__len__")


def _read_csv(path: Path) -> list[dict]:
    import pandas as pd

    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""], encoding="utf-8")
    except (ValueError, pd.errors.ParserError) as err:
        raise ValueError(f"{path} is not a readable CSV file: {err}") from None
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def _read_json(path: Path) -> list[dict]:
    """A JSON list of objects, or one object per line (JSON Lines, also accepted in a ``.json`` file)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {err.lineno} is not valid JSON: {err.msg} (column {err.colno})") from None
        where = lambda i: f"{path} item {i}"  # noqa: E731
    else:
        records, numbers = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"{path} line {number} is not valid JSON: {err.msg} (column {err.colno}); "
                        "give one JSON object per line, or a JSON list of objects"
                    ) from None
                numbers.append(number)
        where = lambda i: f"{path} line {numbers[i]}"  # noqa: E731
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(
                f"{where(i)} is a JSON {type(record).__name__}, not an object: each row must be "
                '{"column": value, ...}'
            )
    return records


def directory_splits(path: Path) -> dict[str, list[Path]]:
    """The splits of a local directory and their files, named as ``datasets.load_dataset(dir)`` names them.

    ``train.*`` / ``training.*`` → "train"; ``validation.*``, ``valid.*``, ``val.*``, ``dev.*`` → "validation";
    ``test.*``, ``eval.*`` → "test" (also as folders, or with suffixes such as ``train-00001.jsonl``); a directory
    with no such names is one "train" split. ``{}`` when it holds no data file.
    """
    from datasets.data_files import DataFilesDict, get_data_patterns

    saved = saved_splits(path)
    if saved is not None:
        return {name: [path / folder] if folder else [path] for name, folder in saved.items()}
    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except FileNotFoundError:  # datasets' EmptyDatasetError and DataFilesNotFoundError: no data file in it
        return {}
    return {str(split): [Path(f) for f in found] for split, found in files.items() if found}


#: the files ``datasets``' ``save_to_disk`` writes: a ``DatasetDict``'s list of splits, a ``Dataset``'s state
SAVED_DICT, SAVED_DATASET = "dataset_dict.json", "state.json"


def saved_splits(path: Path) -> dict[str, str] | None:
    """The splits of a directory written by ``datasets``' ``save_to_disk``, named as ``directory_splits`` names them
    (``val`` → "validation") → the split's folder in it (``""``: a ``Dataset`` saved alone, one "train" split);
    None for any other directory."""
    if (path / SAVED_DICT).is_file():
        try:
            names = json.loads((path / SAVED_DICT).read_text())["splits"]
        except (ValueError, KeyError, TypeError):
            names = sorted(p.name for p in path.iterdir() if (p / SAVED_DATASET).is_file())
        return {SPLIT_ALIASES.get(str(name), str(name)): str(name) for name in names}
    if (path / SAVED_DATASET).is_file() and any(path.glob("*.arrow")):
        return {"train": ""}
    return None


def _load_saved(path: Path, folders: dict[str, str], split: str) -> Table:
    """One split of a ``save_to_disk`` directory, read with ``datasets.load_from_disk``."""
    from datasets import load_from_disk

    folder = folders.get(SPLIT_ALIASES.get(split, split))
    if folder is None:
        raise ValueError(
            f"{str(path)!r} (a dataset saved with save_to_disk) has no split {split!r}; its splits are "
            f"{sorted(folders)}: choose one with {option('data.train_split')} / {option('data.val_split')}"
        )
    dataset = load_from_disk(str(path / folder) if folder else str(path))
    return dataset, list(dataset.column_names)


def _load_directory_split(path: Path, split: str) -> Table:
    """One split of a local directory: its .json/.jsonl/.csv/.parquet files read as ``read_data_file`` reads them
    (the formats may differ between splits: ``train.csv`` + ``validation.jsonl``); other files via ``datasets``; a
    directory written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` and its splits) via ``load_from_disk``."""
    saved = saved_splits(path)
    if saved is not None:
        return _load_saved(path, saved, split)
    splits = directory_splits(path)
    if not splits:
        raise ValueError(
            f"directory {str(path)!r} holds no data file: give it e.g. train.jsonl (and validation.jsonl), "
            f"as {sorted(FILE_BUILDERS)} files"
        )
    files = splits.get(SPLIT_ALIASES.get(split, split))
    if files is None:
        raise ValueError(
            f"directory {str(path)!r} has no split {split!r}; its splits are "
            + ", ".join(f"{name} ({', '.join(f.name for f in found)})" for name, found in splits.items())
        )
    if any(f.suffix.lower() not in FILE_BUILDERS for f in files):
        from datasets import load_dataset

        try:
            dataset = load_dataset(str(path), split=split)
        except ValueError as err:
            raise ValueError(f"cannot load split {split!r} from directory {str(path)!r}: {err}") from err
        return dataset, list(dataset.column_names)
    tables = [read_data_file(f) for f in files]
    if len(tables) == 1:
        return tables[0]
    columns = list(dict.fromkeys(c for _, cols in tables for c in cols))
    return [{c: r.get(c) for c in columns} for rows, _ in tables for r in rows], columns


def _load_dataset(source: str, split: str) -> Table:
    """The rows of a local file, a local directory's split or a hub dataset's split, and their columns."""
    path = Path(source)
    if path.is_file():  # a single file is a single split: `split` does not apply
        return read_data_file(path)
    if path.is_dir():
        return _load_directory_split(path, split)
    from datasets import load_dataset

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    unreachable = None if offline or hub_offline() else hub_unreachable()  # without a network: seconds, not minutes
    try:
        with _offline(bool(unreachable)):
            dataset = load_dataset(source, split=split)
    except Exception as err:  # noqa: BLE001 — hub failures come in many types; say what was tried
        raise ValueError(
            f"{source!r} is neither a built-in task ({sorted(TASKS)}) nor an existing local file or directory, and loading "
            f"it as a Hugging Face Hub dataset (split {split!r}) failed"
            + (" — HF_HUB_OFFLINE is set, so the hub cannot be reached" if offline else "")
            + (f" — {unreachable}; and {offline_hint(f'dataset {source!r}')}" if unreachable else "")
            + f": {type(err).__name__}: {err}"
        ) from err
    return dataset, list(dataset.column_names)


@contextmanager
def _offline(on: bool):
    """Have ``datasets`` and ``huggingface_hub`` use the local cache only (they read HF_HUB_OFFLINE at import time)."""
    if not on:
        yield
        return
    import datasets
    import huggingface_hub

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def check_text_file(path: Path) -> None:
    """A JSON/JSONL/CSV data file must hold something and be UTF-8: say which line is not (datasets would not)."""
    with open(path, "rb") as f:
        empty = True
        for number, line in enumerate(f, start=1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path} line {number} is not UTF-8 text: byte {line[err.start : err.start + 1]!r} at column {err.start + 1} "
                    f"({err.reason}). Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path.name}` if it is "
                    "Latin-1)"
                ) from None
            empty = empty and not text.strip()
    if empty:
        raise ValueError(
            f"{path} is empty: it holds no rows. Give a file with at least one row "
            f"({'one JSON object per line' if path.suffix.lower() == '.jsonl' else 'a header and rows' if path.suffix.lower() == '.csv' else 'a list of objects'})"
        )


def subset_indices(total: int, n: int | None, seed: int) -> list[int]:
    """The rows ``load_prompt_rows`` keeps of ``total``: all when ``n`` is None or >= total, else a seeded sample of ``n`` in file order."""
    if n is None or n >= total:
        return list(range(total))
    return sorted(random.Random(seed).sample(range(total), n))


def load_prompt_rows(
    source: str,
    split: str = "train",
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    n: int | None = None,
    seed: int = 0,
    table: Table | None = None,
    **task_kwargs,
) -> list[dict]:
    """Load prompt rows as dicts: every column under its own name, plus ``"prompt"`` and ``"answer"`` (unless
    ``answer_column`` is None) holding the prompt and answer columns' values. Values are as the file writes them
    (see ``read_data_file``: a CSV cell is text, ``"000"`` stays ``"000"``).

    Args:
        source: a built-in task name (``TASKS``: rows are generated, ``n`` is required, ``split`` is
            ``"train"`` or ``"validation"``/``"val"``/``"test"`` — the held-out prompts), a local
            ``.json``/``.jsonl``/``.parquet``/``.csv`` file (one split: ``split`` is ignored), a local
            directory (its ``split``: ``train.*``, ``validation.*``/``val.*``, ``test.*`` files, see
            ``directory_splits``; the formats may differ between splits), or a Hub dataset name.
        split: which split to load (see ``source``).
        prompt_column: the column holding prompts, also given as ``"prompt"``. A prompt may be a string
            or a list of chat messages (``{"role", "content"}`` dicts).
        answer_column: the column holding reference answers, also given as ``"answer"``; None for none.
        n: at most this many rows (a seeded random subset in file order); None for all. For a
            built-in task exactly ``n`` distinct prompts are generated.
        seed: the seed for generating task rows or choosing the subset.
        table: rows already in memory (:func:`in_memory_table`), in place of loading ``source``, which names them.
        **task_kwargs: options of the built-in task (e.g. ``digits=2``); rejected for files.

    Raises:
        ValueError: a missing column (naming the columns the dataset has), a ``prompt_column`` /
            ``answer_column`` that would hide the data's own ``prompt`` / ``answer`` column, an unreadable source, a
            task too small for ``n``, or a row whose prompt is empty, whitespace only, or neither a
            string nor a list of ``{"role", "content"}`` messages (naming the source and row index).
    """
    if source in TASKS:
        if n is None:
            raise ValueError(f"built-in task {source!r} needs n (the number of prompts to generate)")
        return make_split(source, split, n, seed, **task_kwargs)
    if task_kwargs:
        raise TypeError(
            f"options {sorted(task_kwargs)} only apply to built-in tasks {sorted(TASKS)}, not to {source!r}"
        )
    table, columns = _load_dataset(source, split) if table is None else table
    if len(table) == 0:
        raise ValueError(
            f"{source!r} holds no rows{'' if Path(source).is_file() else f' in split {split!r}'}: give data with at least one row"
        )
    for setting, column in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if column is not None and column not in columns:
            raise ValueError(missing_column_message(source, setting, column, columns))
    for setting, column, alias in (
        ("prompt_column", prompt_column, "prompt"),
        ("answer_column", answer_column, "answer"),
    ):
        if column not in (None, alias) and alias in columns:
            raise ValueError(
                f"{option('data.' + setting, column)} would hide {source!r}'s own {alias!r} column (the "
                f"rewards get {column!r} as {alias!r}); its columns are {columns}. Rename one of the two "
                f"columns, or give {option('data.' + setting, alias)}"
            )
    indices = list(range(len(table)))
    if n is not None and n < len(table):
        indices = subset_indices(len(table), n, seed)
    records = [table[i] for i in indices] if isinstance(table, list) else table.select(indices)
    where = source if Path(source).is_file() else f"{source} [{split}]"
    rows = []
    for index, record in zip(indices, records):
        row = dict(record)  # every column under its own name; the prompt and answer also under "prompt" / "answer"
        row["prompt"] = row[prompt_column]
        problem = prompt_problem(row["prompt"])
        if problem:
            raise ValueError(
                f"{where} row {index}: the prompt is {problem}, got {row['prompt']!r} "
                f"(column {prompt_column!r}); fix or drop the row"
            )
        if answer_column is not None:
            row["answer"] = row[answer_column]
        rows.append(row)
    return rows


#: columns that usually hold a dataset's prompts / reference answers (TRL's and common Hub datasets' names), in order
COLUMN_CANDIDATES = {
    "prompt_column": ("prompt", "question", "problem", "query", "instruction", "input", "messages", "text"),
    "answer_column": (
        "answer",
        "ground_truth",
        "solution",
        "label",
        "labels",
        "target",
        "reference",
        "gold",
        "final_answer",
        "answers",
        "output",
        "completion",
        "response",
    ),
}


def suggest_column(setting: str, columns: list[str]) -> str | None:
    """The column of ``columns`` that most likely is the one ``setting`` (``prompt_column``/``answer_column``) names:
    a known name (``ground_truth``, ``solution``, ``label``, ...), compared without case; None when none is."""
    lower = {c.lower(): c for c in reversed(columns)}
    taken = COLUMN_CANDIDATES["prompt_column" if setting == "answer_column" else "answer_column"][:1]
    for name in COLUMN_CANDIDATES.get(setting, ()):
        if name in lower and name not in taken:
            return lower[name]
    return None


def missing_column_message(source: str, setting: str, column: str, columns: list[str]) -> str:
    """``'x.jsonl' has no column 'answer' (--data.answer_column answer); its columns are [...]. Its answers look
    like column 'ground_truth': --data.answer_column ground_truth``, and for answers the option to go without."""
    text = f"{source!r} has no column {column!r} ({option('data.' + setting, column)}); its columns are {columns}. "
    found = suggest_column(setting, columns)
    kind = "prompts" if setting == "prompt_column" else "reference answers"
    if found is not None:
        text += f"Its {kind} look like column {found!r}: {option('data.' + setting, found)}"
    else:
        text += f"Name the column holding the {kind}: {option('data.' + setting)} COLUMN"
    if setting == "answer_column":
        text += f" ({option('data.answer_column', None)} for data without answers)"
    return text


def prompt_problem(prompt) -> str | None:
    """Why ``prompt`` cannot be sampled from (None when it can): a non-blank string or a non-empty message list."""
    if isinstance(prompt, str):
        return "empty (or whitespace only)" if not prompt.strip() else None
    if isinstance(prompt, list):
        if not prompt:
            return "empty (a list of no messages)"
        if all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            return None
    return "neither a string nor a list of {'role': str, 'content': str} messages"


def check_prompt_lengths(rows: list[dict], encode: Callable[[list[dict]], list], where: Callable[[int], str]) -> None:
    """Encode every row as sampling will (``encode``: rows → prompt ids, raising ``ValueError`` for a prompt that does
    not fit); the first that fails is named by ``where(position)`` (its file and row), before any training."""
    for position, row in enumerate(rows):
        try:
            encode([row])
        except ValueError as err:
            raise ValueError(f"{where(position)}: {re.sub(r'^prompt 0 ', 'the prompt ', str(err))}") from None


def encode_prompts(
    tokenizer,
    prompts: list,
    *,
    chat_template: bool | None = None,
    max_prompt_length: int,
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, ready for generation; never truncates.

    With a chat template (``chat_template=True``, or None and the tokenizer has one) each prompt
    becomes ``[system?, user]`` messages rendered with ``add_generation_prompt=True``, then
    tokenized without adding special tokens (the template writes its own). A prompt may also be a
    list of messages already. Without a chat template the raw text is tokenized with the
    tokenizer's own special tokens (e.g. a BOS if it adds one); ``system_prompt`` is then
    prepended followed by a newline. ``tools``: JSON schemas passed to the chat template's ``tools=``;
    ``template_kwargs``: more variables for the template (``{"enable_thinking": False}``).

    Raises:
        ValueError: a prompt longer than ``max_prompt_length`` tokens (naming its index, length and
            the limit), or ``chat_template=True`` for a tokenizer without one, or a message-list
            prompt without a chat template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise ValueError(
            f"{option(CHAT_TEMPLATE, chat_template)}, but {_tokenizer_name(tokenizer)} has no chat template: "
            f"give {option(CHAT_TEMPLATE, None)} (use it when there is one) or "
            f"{option(CHAT_TEMPLATE, False)} (prompts as plain text), or a {option('model.policy.name')} whose "
            "tokenizer has one"
        )
    encoded = []
    for i, prompt in enumerate(prompts):
        if use_template:
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if system_prompt is not None and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": system_prompt}, *messages]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **template_arguments(tools, template_kwargs)
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            if not isinstance(prompt, str):
                why = (
                    (
                        f"{_tokenizer_name(tokenizer)} has no chat template to render them with; give a "
                        f"{option('model.policy.name')} whose tokenizer has one, or prompts as text (a text column as "
                        f"{option('data.prompt_column')})"
                    )
                    if not has_template
                    else (
                        f"chat templating is off ({option(CHAT_TEMPLATE, chat_template)}); give "
                        f"{option(CHAT_TEMPLATE, None)} to render them with the tokenizer's template"
                    )
                )
                raise ValueError(f"prompt {i} is a list of chat messages, but {why}")
            ids = text_prompt_ids(tokenizer, prompt if system_prompt is None else f"{system_prompt}\n{prompt}")
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt {i} is {len(ids)} tokens, longer than "
                + _limit_text(max_prompt_length)
                + " (prompts are never truncated)"
            )
        encoded.append(list(ids))
    return encoded


#: what lit_gspo passes to ``apply_chat_template`` itself: not for ``chat_template_kwargs``
_RENDERING_ARGUMENTS = {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize"}
_RENDERING_ARGUMENTS |= {"continue_final_message", "return_dict", "return_tensors", "chat_template", "padding"}


def check_template_kwargs(template_kwargs: dict | None) -> dict:
    """``chat_template_kwargs`` as a dict of template variables, or a ValueError naming what is wrong with it."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise ValueError(
            f"chat_template_kwargs must map template variable names to values, e.g. {{'enable_thinking': False}}; "
            f"got {template_kwargs!r}"
        )
    taken = sorted(_RENDERING_ARGUMENTS & set(template_kwargs))
    if taken:
        raise ValueError(
            f"chat_template_kwargs {taken} are apply_chat_template's own arguments, which lit_gspo sets; "
            "give template variables only (e.g. enable_thinking)"
        )
    return dict(template_kwargs)


def template_arguments(tools: list[dict] | None, template_kwargs: dict | None) -> dict:
    """The keyword arguments of one ``apply_chat_template`` call: the environment's variables and its tools."""
    return {**(template_kwargs or {}), **({"tools": tools} if tools else {})}


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """A text prompt's ids with the special tokens the tokenizer puts before a text (a BOS) but none it appends after
    one (an EOS or SEP, as tokenizers with ``add_eos_token`` do): a prompt ending in an EOS would end its document
    before the reply starts."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    text_length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    leading = int(len(ids) > text_length and ids[0] == tokenizer.bos_token_id)
    ends = {tokenizer.eos_token_id, tokenizer.sep_token_id} - {None}
    while len(ids) > text_length + leading and ids[-1] in ends:
        ids.pop()
    return ids


#: where a prompt's chat templating is set: on the environment (``model.environment``'s ``chat_template``)
CHAT_TEMPLATE = "model.environment.init_args.chat_template"
MAX_PROMPT_LENGTH = "model.generation.max_prompt_length"


def _tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", None)
    return f"the tokenizer of {name!r}" if name else f"tokenizer {type(tokenizer).__name__}"


class PromptLengthLimit(int):
    """The longest prompt sampling takes, in tokens (an ``int``), and why: the user's ``max_prompt_length``, or less
    when the model's context minus the completion's budget leaves less (:func:`prompt_length_limit`); an error about a
    long prompt then names the setting with the value the user gave, and the arithmetic."""

    setting: int
    context: int | None
    new_tokens: int
    new_tokens_setting: str

    def __new__(
        cls,
        value: int,
        setting: int,
        context: int | None = None,
        new_tokens: int = 0,
        new_tokens_setting: str = "model.generation.max_new_tokens",
    ):
        limit = super().__new__(cls, value)
        limit.setting, limit.context, limit.new_tokens, limit.new_tokens_setting = (
            setting,
            context,
            new_tokens,
            new_tokens_setting,
        )
        return limit


def prompt_length_limit(generation, context: int) -> PromptLengthLimit:
    """``min(max_prompt_length, context − new tokens)`` for ``generation`` (a ``Generation``) and a model whose context
    is ``context`` tokens; the new tokens are the longer of ``max_new_tokens`` and ``val_max_new_tokens``."""
    longer_val = (generation.val_max_new_tokens or 0) > generation.max_new_tokens
    new_tokens = generation.val_max_new_tokens if longer_val else generation.max_new_tokens
    setting = "model.generation.val_max_new_tokens" if longer_val else "model.generation.max_new_tokens"
    return PromptLengthLimit(
        min(generation.max_prompt_length, context - new_tokens),
        generation.max_prompt_length,
        context,
        new_tokens,
        setting,
    )


def _limit_text(limit: int) -> str:
    """What a too-long prompt is longer than, naming the setting with the user's value."""
    setting = getattr(limit, "setting", int(limit))
    context, new_tokens = getattr(limit, "context", None), getattr(limit, "new_tokens", 0)
    if context is None or context - new_tokens > setting:
        return f"{option(MAX_PROMPT_LENGTH, setting)}: raise it or shorten the prompt"
    return (
        f"the {int(limit)} tokens a prompt can have: {option(MAX_PROMPT_LENGTH, setting)}, but the model's context "
        f"of {limit.context} tokens less {option(limit.new_tokens_setting, limit.new_tokens)} for the completion "
        f"leaves {int(limit)}; shorten the prompt, lower {option(limit.new_tokens_setting)}, or use a model with a "
        "longer context"
    )
