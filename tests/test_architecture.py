"""The dependency direction the README states: objectives ← learner ← module ← cli, and no Lightning below module.py."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_gspo"
STAGES = ["objectives", "advantages", "rewards", "envs", "engines", "collect", "learner", "rollout", "warm_start",
          "fast_generate", "config", "diagnostics", "models", "evaluate", "mismatch"]


def test_the_stages_import_no_lightning():
    code = ("import sys\n" + "".join(f"import lit_gspo.{m}\n" for m in STAGES) +
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing the stages pulled in {out}"


def imported_lit_gspo_modules(path: Path) -> set[str]:
    """Every ``lit_gspo.x`` module a file imports (top level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_gspo"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("lit_gspo"))
    return names


def test_dependencies_point_one_way():
    above = {  # a file must not import what sits above it
        "objectives": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.collect", "lit_gspo.cli", "lit_gspo.rlcli"),
        "learner.py": ("lit_gspo.module", "lit_gspo.collect", "lit_gspo.cli", "lit_gspo.rlcli"),
        "mismatch.py": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.collect", "lit_gspo.cli", "lit_gspo.rlcli"),
        "collect.py": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.cli", "lit_gspo.rlcli"),
        "engines": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.collect", "lit_gspo.cli", "lit_gspo.rlcli"),
        "envs": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.collect", "lit_gspo.cli", "lit_gspo.rlcli"),
        "evaluate.py": ("lit_gspo.learner", "lit_gspo.module", "lit_gspo.cli", "lit_gspo.rlcli", "lit_gspo.eval_cli"),
        "module.py": ("lit_gspo.cli", "lit_gspo.rlcli", "lit_gspo.ablate", "lit_gspo.eval_cli"),
    }
    for part, forbidden in above.items():
        files = [PACKAGE / part] if part.endswith(".py") else sorted((PACKAGE / part).glob("*.py"))
        for file in files:
            bad = {m for m in imported_lit_gspo_modules(file) if m.startswith(forbidden)}
            assert not bad, f"{file.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


#: what reaches into Lightning's internals: the trainer's private attributes, the logger connector, loop progress,
#: private hooks of Lightning classes we subclass, and swapping an object's class (a Lightning strategy's, before)
PRIVATE_LIGHTNING = re.compile(
    r"trainer\._[a-z]|\._logger_connector|_instantiate_trainer|_check_log_dir_exists|epoch_loop\.|batch_progress|"
    r"launcher\.procs|\bself\._trainer\b|\._fs\b|_get_next_version|_(?:tensor|data)_parallel_size\b|"
    r"_save_distributed_checkpoint|\._device_mesh|__class__\s*=(?!=)")
#: the one ``__class__`` assignment left is a torch optimizer's (``optim.shard_aware``), not a Lightning object's
ALLOWED = {("optim.py", "optimizer.__class__ = _CLASSES[cls]")}


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
    old = ["connector = trainer._logger_connector", "batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready",
           "strategy.__class__ = AtomicModelParallelStrategy", "return super()._instantiate_trainer(config, callbacks)",
           "    def _check_log_dir_exists(self) -> None:", "for proc in getattr(launcher, 'procs', None) or []: launcher.procs",
           "if self._trainer is not None:", "if self._tensor_parallel_size == 'auto':",
           "if not self._save_distributed_checkpoint:"]
    (tmp_path / "lit_gspo").mkdir()
    for i, line in enumerate(old):
        (tmp_path / "lit_gspo" / f"m{i}.py").write_text(line + "\n")
    assert len(private_lightning_uses(tmp_path / "lit_gspo")) == len(old)
