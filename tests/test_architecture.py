"""The layout is the architecture, and these tests hold it:

    rl/ models/ data/ runtime/   the RL core and what it runs on: no Lightning, nothing from lightning/ or tools/
    lightning/                   the Lightning adapter: never imports tools/
    tools/                       the commands, built on both

and inside rl/ the stages point one way: objectives ← learn ← (collect, advantages) ← nothing in rl/ imports above it.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_gspo"
LIGHTNING_FREE = ("rl", "models", "data", "runtime")
#: the package's top level: the public API, ``python -m lit_gspo`` and the old-path aliases; the rest is in folders
TOP_LEVEL = {"__init__.py", "__main__.py"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions), with ``from m import n`` also as ``m.n``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layout_violations(package: Path) -> list[str]:
    """Each import that breaks the folder rules, as ``file: imports name``."""
    rules = {
        folder: ("lightning", "pytorch_lightning", "lit_gspo.lightning", "lit_gspo.tools") for folder in LIGHTNING_FREE
    }
    rules["lightning"] = ("lit_gspo.tools",)
    found = []
    for folder, forbidden in rules.items():
        for path in sorted((package / folder).rglob("*.py")):
            for name in sorted(imports_of(path)):
                if _under(name, forbidden):
                    found.append(f"{path.relative_to(package.parent)}: imports {name}")
    return found


def test_the_folders_keep_their_dependency_rules():
    found = layout_violations(PACKAGE)
    assert not found, "imports against the layout:\n" + "\n".join(found)


def test_the_layout_check_catches_a_lightning_import_under_rl(tmp_path):
    """Planted in a copy of the package, each forbidden import is reported (so the test above can fail)."""
    import shutil

    copy = tmp_path / "lit_gspo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert layout_violations(copy) == []
    (copy / "rl" / "learn" / "planted.py").write_text("def f():\n    from lightning.pytorch import Callback\n")
    (copy / "runtime" / "planted.py").write_text("import lit_gspo.lightning.module\n")
    (copy / "lightning" / "planted.py").write_text("from lit_gspo.tools import compare\n")
    assert sorted(layout_violations(copy)) == [
        "lit_gspo/lightning/planted.py: imports lit_gspo.tools",
        "lit_gspo/lightning/planted.py: imports lit_gspo.tools.compare",
        "lit_gspo/rl/learn/planted.py: imports lightning.pytorch",
        "lit_gspo/rl/learn/planted.py: imports lightning.pytorch.Callback",
        "lit_gspo/runtime/planted.py: imports lit_gspo.lightning.module",
    ]


def test_importing_every_lightning_free_module_loads_no_lightning():
    """The static rule above, checked at run time too (an import through a third package would slip past it)."""
    modules = sorted(
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for folder in LIGHTNING_FREE
        for p in (PACKAGE / folder).rglob("*.py")
    )
    code = (
        "import sys, importlib\n" + f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing rl/, models/, data/, runtime/ pulled in {out}"


def test_the_top_level_holds_only_the_public_api():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "rl",
        "models",
        "data",
        "runtime",
        "lightning",
        "tools",
    }


def test_the_rl_stages_point_one_way():
    above = {  # a file must not import what sits above it
        "rl/objectives": (
            "lit_gspo.rl.learn",
            "lit_gspo.rl.collect",
            "lit_gspo.rl.advantages",
            "lit_gspo.rl.engines",
            "lit_gspo.rl.envs",
            "lit_gspo.rl.rewards",
        ),
        "rl/learn": ("lit_gspo.rl.collect", "lit_gspo.rl.engines", "lit_gspo.rl.envs", "lit_gspo.rl.rewards"),
        "rl/engines": ("lit_gspo.rl.learn", "lit_gspo.rl.collect", "lit_gspo.rl.objectives"),
        "rl/envs": ("lit_gspo.rl.learn", "lit_gspo.rl.collect", "lit_gspo.rl.objectives"),
        "rl/rewards": ("lit_gspo.rl.learn", "lit_gspo.rl.collect", "lit_gspo.rl.objectives"),
        "rl/collect": ("lit_gspo.rl.learn", "lit_gspo.rl.objectives"),
    }
    for part, forbidden in above.items():
        for file in sorted((PACKAGE / part).rglob("*.py")):
            bad = {m for m in imports_of(file) if _under(m, forbidden)}
            assert not bad, f"{file.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_a_subcommand_imports_only_what_it_needs():
    """``lit-gspo compare --help`` loads neither Lightning nor transformers (``lit_gspo.tools.main`` imports lazily)."""
    code = (
        "import sys\nfrom lit_gspo.tools.main import main\ntry:\n    main(['compare', '--help'])\nexcept SystemExit:\n"
        "    pass\nprint(sorted({k.split('.')[0] for k in sys.modules} & {'lightning', 'pytorch_lightning', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()[
        -1
    ]
    assert out == "[]", f"lit-gspo compare --help imported {out}"


#: what reaches into Lightning's internals: the trainer's private attributes, the logger connector, loop progress,
#: private hooks of Lightning classes we subclass, and swapping an object's class (a Lightning strategy's, before)
PRIVATE_LIGHTNING = re.compile(
    r"trainer\._[a-z]|\._logger_connector|_instantiate_trainer|_check_log_dir_exists|epoch_loop\.|batch_progress|"
    r"launcher\.procs|\bself\._trainer\b|\._fs\b|_get_next_version|(?<!\w)_(?:tensor|data)_parallel_size\b|"
    r"_save_distributed_checkpoint|\._device_mesh|\bcli\._[a-z]|__class__\s*=(?!=)"
)
#: exemptions, as (file name, line of code); none left (``optim.shard_aware`` builds its subclass instead)
ALLOWED: set[tuple[str, str]] = set()


def private_lightning_uses(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE_LIGHTNING.search(code) and (path.name, code.strip()) not in ALLOWED:
                found.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    return found


def test_lit_gspo_uses_only_public_lightning_api():
    found = private_lightning_uses(PACKAGE)
    assert not found, "private Lightning internals used:\n" + "\n".join(found)


def test_the_private_api_check_finds_what_the_old_code_did(tmp_path):
    """The patterns catch each reach into Lightning that lit_gspo used to make (so the test above can fail)."""
    old = [
        "connector = trainer._logger_connector",
        "batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready",
        "strategy.__class__ = AtomicModelParallelStrategy",
        "return super()._instantiate_trainer(config, callbacks)",
        "    def _check_log_dir_exists(self) -> None:",
        "for proc in getattr(launcher, 'procs', None) or []: launcher.procs",
        "if self._trainer is not None:",
        "if self._tensor_parallel_size == 'auto':",
        "if not self._save_distributed_checkpoint:",
        "current = load_yaml(dump(cli._parser(cli.subcommand), cfg))",
    ]
    (tmp_path / "lit_gspo").mkdir()
    for i, line in enumerate(old):
        (tmp_path / "lit_gspo" / f"m{i}.py").write_text(line + "\n")
    assert len(private_lightning_uses(tmp_path / "lit_gspo")) == len(old)
