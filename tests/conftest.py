"""Shared fixtures: a tiny random Llama with fixed special-token ids, for rollout and sampler tests; the ``cuda`` marker."""

import inspect
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_gspo.runtime.own_context import run_in_own_context

PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=23,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def no_global_seed_between_tests():
    """A fit's ``seed_everything`` sets PL_GLOBAL_SEED, which seeds later datamodules and modules: clear it around every test."""
    import os

    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Each test runs in its own copy of the session's context (``contextvars``): what one test leaves in a context
    variable cannot reach another. jsonargparse sets and resets its parser's context variables with tokens, and
    ``cli_main(run=False)`` builds in the caller's context, so a test's CLI stayed referenced there until a later
    parse replaced it. CI once failed with a ``LookupError`` inside jsonargparse's reset while a dead fit of an earlier
    test was being collected (its progress bar in the captured output); not reproduced here. A reset with a token made
    in another context raises ``ValueError`` and changes nothing in this one."""
    test = pyfuncitem.obj
    kwargs = {name: pyfuncitem.funcargs[name] for name in inspect.signature(test).parameters}
    run_in_own_context(test, **kwargs)
    return True


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what Python, pytest and the linters keep beside the code (not a test's output)
TOOL_CACHES = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks"}


def checkout_paths() -> dict[str, int]:
    """Every file and folder of the checkout, relative to it, with a file's modification time (a folder's is 0: it
    changes when Python adds a ``__pycache__`` to it); tool caches left out."""
    paths = {}
    for folder, subfolders, files in os.walk(CHECKOUT):
        subfolders[:] = [d for d in subfolders if d not in TOOL_CACHES and not d.endswith(".egg-info")]
        paths.update((os.path.relpath(os.path.join(folder, name), CHECKOUT), 0) for name in subfolders)
        for name in files:
            path = os.path.join(folder, name)
            paths[os.path.relpath(path, CHECKOUT)] = os.stat(path, follow_symlinks=False).st_mtime_ns
    return paths


@pytest.fixture(scope="session")
def checkout_before() -> list[dict[str, int]]:
    return [checkout_paths()]


@pytest.fixture(autouse=True)
def writes_nothing_into_the_checkout(checkout_before):
    """A test's runs go under its ``tmp_path``: a path relative to the working directory (a config's
    ``default_root_dir: runs/...`` read after the test's own setting) lands in the checkout, where a second run of the
    suite meets the first one's output. Fails the test that created or rewrote a file or folder there (rewrote: an
    earlier run's leftover output, e.g. ``hf_model/``, is met again by the same mistake)."""
    yield
    now = checkout_paths()
    new = sorted(path for path, mtime in now.items() if checkout_before[0].get(path) != mtime)
    checkout_before[0] = now
    assert not new, f"the test wrote into the checkout ({CHECKOUT}), not under its tmp_path: {new[:5]}"


#: ``LIT_GSPO_CUDA_TESTS_ON=cpu`` runs the ``cuda`` tests on that device instead (a dry run of their code without a GPU)
CUDA_TESTS_ON = os.environ.get("LIT_GSPO_CUDA_TESTS_ON", "cuda")


def _parse_each_docstring_once():
    """Each LightningCLI built in a test re-reads and re-parses the source of every class it documents (jsonargparse's
    ``parse_docstring`` with attribute docstrings: ~1.3 s of a 3 s quickstart fit); the sources do not change during a
    session, so the suite parses each once. The parsed docstrings are the same objects jsonargparse would build."""
    try:
        from jsonargparse import _optionals
    except ImportError:
        return
    original = getattr(_optionals, "parse_docstring", None)
    if not hasattr(_optionals, "get_docstring_parse_options") or original is None or hasattr(original, "parsed"):
        return
    parsed = {}

    def parse_docstring(component, params=False, logger=None):
        options = _optionals.get_docstring_parse_options()
        key = (component, params, options["style"], options["attribute_docstrings"])
        try:
            hash(key)
        except TypeError:  # an unhashable component
            return original(component, params=params, logger=logger)
        if key not in parsed:
            parsed[key] = original(component, params=params, logger=logger)
        return parsed[key]

    parse_docstring.parsed = parsed
    _optionals.parse_docstring = parse_docstring


#: torch's intra-op threads in the test process (``LIT_GSPO_TEST_THREADS``, default 1). The tests' models are tiny: a
#: second thread does not speed them up, and on a shared machine every parallel region waits for a core another process
#: holds (the default suite ran ~3x slower with 2 threads on 2 busy cores). The tests of thread behaviour set their own
#: count (test_hardware's two-thread fits); subprocess runs (golden, distributed) set OMP_NUM_THREADS=1 themselves.
TEST_THREADS = int(os.environ.get("LIT_GSPO_TEST_THREADS", "1"))


def pytest_configure(config):
    # the tests run commands as a user types them at the repository's root (`--config configs/quickstart.yaml`, an
    # ablation's `base:`): `pytest /path/to/tests` from another directory, or an IDE's runner, must see the same paths
    os.chdir(config.rootpath)
    _parse_each_docstring_once()
    torch.set_num_threads(TEST_THREADS)


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the long tests (markers `slow` and `distributed`: golden fits, the per-objective "
        "fits, several processes, every Lightning habit, the README tour); `.ci/run` runs them",
    )
    parser.addoption(
        "--experiments",
        action="store_true",
        default=False,
        help="run the tests that reproduce a documented result by training a real model (marker "
        "`experiment`: tens of minutes each on 2 cores; not in CI)",
    )
    parser.addoption(
        "--faults",
        action="store_true",
        default=False,
        help="run the fault-injection tests (marker `faults`): real signals and SIGKILLs of CLI runs in "
        "subprocesses, a few minutes; `pytest -m faults --faults`",
    )


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests are skipped where torch sees no CUDA device (CI), never failed;
    ``@pytest.mark.faults`` tests run only with ``--faults``; ``slow`` and ``distributed`` ones only with ``--runslow``
    (the default ``pytest`` is the developer's loop of a few minutes; ``.ci/run`` runs everything)."""
    skips = []
    if not config.getoption("--runslow"):
        long = pytest.mark.skip(reason="long (golden fits, several processes, ...): run with `pytest --runslow`")
        skips += [("slow", long), ("distributed", long)]
    if not (CUDA_TESTS_ON != "cuda" or torch.cuda.is_available()):
        skips.append(("cuda", pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")))
    if not config.getoption("--experiments"):
        skips.append(
            (
                "experiment",
                pytest.mark.skip(reason="trains a real model (tens of minutes): `pytest -m experiment --experiments`"),
            )
        )
    if not config.getoption("--faults"):
        skips.append(
            ("faults", pytest.mark.skip(reason="fault injection (minutes): run with `pytest -m faults --faults`"))
        )
    for item in items:
        for marker, skip in skips:
            if (
                item.get_closest_marker(marker) is not None
            ):  # a marker, not any keyword (a parameter id may be "distributed")
                item.add_marker(skip)


@pytest.fixture
def cuda_device() -> torch.device:
    """The device of the ``cuda`` tests: ``cuda``, or ``LIT_GSPO_CUDA_TESTS_ON`` when set."""
    return torch.device(CUDA_TESTS_ON)
