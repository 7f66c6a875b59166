"""The dependency direction the README states: objectives ← learner ← module ← cli, and no Lightning below module.py."""

import ast
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
