"""``load_policy``: one entry point for every way a policy can be named.

Resolution order for ``name_or_path``:

1. a built-in name (``tiny-llama``, ``tiny-qwen3-moe``): random init from a tiny config + char tokenizer;
2. a GGUF alias (``smollm2-135m-instruct``), a path ending in ``.gguf``, a ``gguf_file=`` argument, or a
   local directory holding a single ``.gguf`` and no ``config.json``: transformers' GGUF loader
   (de-quantized to ``dtype``, quantizer flags dropped so it trains and saves);
3. an existing local directory: ``from_pretrained``;
4. a hub id of the form ``org/name``: ``from_pretrained`` (needs network or the HF cache).

Anything else (a bare unknown name, a missing path) raises ``ValueError`` listing the built-in names.
The returned tokenizer always has a pad token (falls back to eos, then unk, with a warning) and
``padding_side="left"`` (decoder-only generation needs left padding).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lit_gspo.runtime.extras import require_installed
from lit_gspo.runtime.hub import hub_offline, hub_unreachable, offline_hint

from .builders import build_from_config, tiny_llama_config, tiny_qwen3_moe_config
from .gguf_utils import GGUF_ALIASES, GGUF_PACKAGES, drop_quantizer, gguf_tokenizer, packaged_gguf_path
from .remote_code import code_trusted_by
from .tokenizer import char_tokenizer

log = logging.getLogger(__name__)

#: built-in name → config factory (kwargs = config_overrides)
BUILTIN_MODELS: dict[str, Callable[..., Any]] = {
    "tiny-llama": tiny_llama_config,
    "tiny-qwen3-moe": tiny_qwen3_moe_config,
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "16": torch.float16,
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def known_names() -> list[str]:
    """Built-in model names and GGUF aliases accepted by :func:`load_policy`."""
    return sorted(BUILTIN_MODELS) + sorted(GGUF_ALIASES)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32"``/``"bf16"``/... (or a ``torch.dtype``) to a ``torch.dtype``; error lists the valid strings."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def load_policy(
    name_or_path: str,
    *,
    gguf_file: str | None = None,
    config_overrides: dict | None = None,
    dtype: str = "float32",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (or build) a causal-LM policy and its tokenizer.

    Args:
        name_or_path: built-in name, GGUF alias, ``.gguf`` path, local HF directory or hub id ``org/name``.
        gguf_file: file name of a GGUF checkpoint inside ``name_or_path`` (directory or hub repo).
        config_overrides: config attributes to set (built-ins: kwargs of the tiny config factory;
            pretrained models: passed to ``from_pretrained`` which updates the loaded config).
        dtype: parameter dtype, e.g. ``"float32"`` or ``"bfloat16"``.
        seed: seed of the random init of built-ins (the caller's RNG state is left untouched).
        trust_remote_code: run the Python a pretrained model's own directory or repo holds for its architecture or
            tokenizer (``auto_map`` in its config). False: such a model is refused at once, never prompted for.

    Returns:
        ``(model, tokenizer)``: the model in eval mode (Lightning switches it to train mode in ``fit``),
        the tokenizer with a pad token and left padding.
    """
    torch_dtype = parse_dtype(dtype)
    overrides = dict(config_overrides or {})
    check_no_loading_arguments(overrides)
    name = str(name_or_path)

    if name in BUILTIN_MODELS and gguf_file is None:
        config = BUILTIN_MODELS[name](**overrides)
        model = build_from_config(config, seed=seed, dtype=torch_dtype)
        tokenizer = char_tokenizer()
        if config.vocab_size < len(tokenizer):
            raise ValueError(
                f"config_overrides vocab_size={config.vocab_size} is smaller than the char tokenizer's "
                f"{len(tokenizer)} tokens"
            )
    else:
        source, gguf = _resolve_source(name, gguf_file)
        model, tokenizer = _load_pretrained(source, gguf, overrides, torch_dtype, trust_remote_code)

    _ensure_pad_token(model, tokenizer)
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


_PRECISION = (
    "the policy's parameters load in fp32 (the master weights); compute in bf16 with --trainer.precision bf16-mixed, "
    "and the update on bf16 casts with --model.update.param_dtype bf16"
)
#: ``from_pretrained``'s own arguments that other settings give: in config_overrides (TRL's ``model_init_kwargs``
#: habit) a second value for the same keyword, or, on a built-in model, ignored
LOADING_ARGUMENTS = {
    "dtype": _PRECISION,
    "torch_dtype": _PRECISION,
    "trust_remote_code": "use --model.policy.trust_remote_code",
    "gguf_file": "use --model.policy.gguf_file",
}


def check_no_loading_arguments(overrides: dict) -> None:
    """A ValueError naming the settings for the loading arguments in ``overrides`` (``--model.policy.config``)."""
    given = [key for key in overrides if key in LOADING_ARGUMENTS]
    if given:
        raise ValueError(
            f"--model.policy.config {given}: not config settings, and not taken from here: "
            + "; ".join(f"{key}: {LOADING_ARGUMENTS[key]}" for key in given)
        )


def _unknown(name: str, why: str) -> ValueError:
    return ValueError(
        f"cannot load policy {name!r}: {why}. Valid choices: a built-in name {sorted(BUILTIN_MODELS)}, "
        f"a GGUF alias {sorted(GGUF_ALIASES)}, a path to a .gguf file, a local Hugging Face model directory, "
        f"or a hub id of the form 'org/name'"
    )


def _resolve_source(name: str, gguf_file: str | None) -> tuple[str, str | None]:
    """Return ``(directory or hub id, gguf file name or None)`` for a non-built-in name."""
    if name in GGUF_ALIASES:
        path = packaged_gguf_path(name)
        return os.path.dirname(path), os.path.basename(path)
    expanded = os.path.expanduser(name)
    if expanded.lower().endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError(f"give the GGUF either as a path ({name!r}) or as gguf_file={gguf_file!r}, not both")
        if not os.path.isfile(expanded):
            raise _unknown(name, "no such .gguf file")
        return os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded)
    if os.path.isdir(expanded):
        if gguf_file is None and not os.path.isfile(os.path.join(expanded, "config.json")):
            ggufs = sorted(f for f in os.listdir(expanded) if f.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                gguf_file = ggufs[0]
            elif len(ggufs) > 1:
                raise ValueError(f"{name!r} holds several GGUF files {ggufs}; pick one with gguf_file=")
            else:
                raise _unknown(name, "the directory has neither config.json nor a .gguf file")
        return expanded, gguf_file
    if os.path.exists(expanded) or name.startswith((".", "/", "~")) or os.sep + os.sep in name:
        raise _unknown(name, "no such directory")
    if _HUB_ID.match(name):
        return name, gguf_file
    raise _unknown(name, "not a built-in name, an existing path, or a hub id 'org/name'")


def _load_pretrained(
    source: str, gguf_file: str | None, overrides: dict, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # always a bool: left None, transformers asks on the terminal whether to run a model's own code
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    if gguf_file is not None:
        require_installed(GGUF_PACKAGES, "loading GGUF checkpoints")
        kwargs["gguf_file"] = gguf_file
    unreachable = None
    if not os.path.isdir(source) and not hub_offline():  # a hub id: without a network, fail in seconds, not minutes
        unreachable = hub_unreachable()
        if unreachable:
            kwargs["local_files_only"] = True
    if overrides.pop("local_files_only", False):  # a loading argument too: for the tokenizer as well, and given once
        kwargs["local_files_only"] = True
    try:
        with code_trusted_by(
            "--model.policy.trust_remote_code true", f"cannot load policy {source!r}", trust_remote_code
        ):
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **overrides)
    except OSError as err:
        if unreachable:
            raise ValueError(f"cannot load policy {source!r}: {unreachable}; and {offline_hint(repr(source))}") from err
        raise _unknown(source if gguf_file is None else f"{source}/{gguf_file}", f"loading failed ({err})") from err
    if gguf_file is not None:
        drop_quantizer(model)
        if os.path.isdir(source):  # a hub id's file is in the hub's cache, where transformers found it
            tokenizer = gguf_tokenizer(tokenizer, os.path.join(source, gguf_file))
        if not getattr(tokenizer, "chat_template", None):
            log.warning("the tokenizer from %s carries no chat template; chat-formatted prompts will fail", gguf_file)
    return model, tokenizer


def _ensure_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token if it has none (eos, else unk, else a new ``<pad>``), and sync the model."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
            log.warning("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
            log.warning("tokenizer has no pad token and no eos; using unk %r as pad", tokenizer.unk_token)
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            model.resize_token_embeddings(len(tokenizer))
            log.warning("tokenizer has no pad, eos or unk token; added '<pad>' and resized the embeddings")
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def load_checkpoint_policy(policy: nn.Module, path: str) -> None:
    """The policy's weights from a Lightning checkpoint of an ``RLModule`` run (keys ``policy.*``)."""
    if Path(path).is_dir():
        raise ValueError(
            f"{path} is a directory: a sharded (distributed) checkpoint. Evaluate the run's hf_model/ "
            "instead, or consolidate it first (lightning.pytorch.utilities.consolidate_checkpoint)"
        )
    # the run's own checkpoint, as `fit --ckpt_path` loads it (it holds RNG states, not only tensors)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    state = {k[len("policy.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("policy.")}
    if not state:
        raise ValueError(f"{path} holds no policy.* weights: not a checkpoint of an RLModule run")
    policy.load_state_dict(state)
    print(f"loaded the policy from {path} (RL step {checkpoint.get('rl_step', '?')})", flush=True)
