"""A learned reward: a sequence-classification model scores each (prompt, completion)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lit_gspo.models.remote_code import code_trusted_by
from lit_gspo.rl.rewards.calling import completion_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModel:
    """reward_i = logit_label(RM(prompt_i ⊕ completion_i)) with ``AutoModelForSequenceClassification``.

    The text scored is the conversation when the prompt is a list of chat messages and the reward
    model's tokenizer has a chat template (the completion appended as the assistant's turn), and
    ``prompt + completion`` otherwise. Each is tokenized as the model's own usage does: a conversation
    with the special tokens its template writes and no others (as ``apply_chat_template(tokenize=True)``),
    a text with those the tokenizer adds to a text (a BOS; BERT's and DeBERTa's ``[CLS] … [SEP]``), as
    ``tokenizer(text)``. The reward is read at each text's last token whatever its id, so a tokenizer
    without a pad token, or whose pad is the token a text ends with (a pad set to the EOS), scores as
    each text alone does. Texts are scored in batches of ``batch_size``, in eval mode without gradient;
    one longer than ``max_length`` tokens is scored on its first ``max_length`` (with a warning). The
    model loads on the first call, so a config names it without loading it.

    A model trained on (question, answer) text pairs reads them as a pair: ``pair=True`` tokenizes
    ``tokenizer(prompt, completion)`` (OpenAssistant's DeBERTa reward models: ``[CLS] prompt [SEP] completion [SEP]``,
    as their model cards score), for text prompts.

    Args:
        model: a local directory or hub id of a sequence-classification model (with its tokenizer), or the model
            itself (as TRL's ``reward_funcs`` takes one; ``RewardSet`` wraps one given as a reward function), used on
            its device and in its dtype.
        label: which output logit is the reward (0 for the usual single-logit reward model).
        batch_size: texts per forward.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, …; None: CUDA when available, else CPU.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (the scores are returned as Python floats).
        max_length: longest text in tokens (None: the tokenizer's ``model_max_length``).
        pair: tokenize the prompt and the completion as a text pair (text prompts only).
        weight: the weight ``RewardSet`` gives this function.
        tokenizer: the model's tokenizer; None: loaded from ``model`` (a given model's ``name_or_path``).
        trust_remote_code: load a model (and tokenizer) whose config maps it to Python of its own (``auto_map``);
            only for a source you trust. False: such a model is refused when it loads.
    """

    def __init__(
        self,
        model: str | nn.Module,
        label: int = 0,
        batch_size: int = 16,
        device: str | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        weight: float = 1.0,
        pair: bool = False,
        tokenizer=None,
        trust_remote_code: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"RewardModel dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"RewardModel batch_size must be >= 1, got {batch_size}")
        if label < 0:
            raise ValueError(f"RewardModel label must be >= 0, got {label}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"RewardModel max_length must be >= 1 or None (the tokenizer's), got {max_length}")
        self.given = model if isinstance(model, nn.Module) else None
        name = getattr(model, "name_or_path", None) if self.given is not None else model
        if self.given is not None and tokenizer is None and not name:
            raise ValueError(
                f"RewardModel was given a {type(model).__name__} without a name_or_path to load its tokenizer from: "
                "give its tokenizer, RewardModel(model, tokenizer=...)"
            )
        self.model_name, self.label, self.batch_size = name or type(model).__name__, label, batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype, self.max_length, self.weight, self.pair = dtype, max_length, weight, pair
        self._model, self._tokenizer = None, tokenizer
        self.trust_remote_code = bool(trust_remote_code)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        trust = self.trust_remote_code  # a bool, never None: transformers would ask on the terminal
        with code_trusted_by("RewardModel(trust_remote_code=True)", f"RewardModel {self.model_name!r}", trust):
            if self._tokenizer is None:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_name, trust_remote_code=trust)
            if self.given is not None:
                model = self.given
            else:
                model = AutoModelForSequenceClassification.from_pretrained(
                    self.model_name, dtype=DTYPES[self.dtype], trust_remote_code=trust
                )
                model = model.to(self.device)
        if self.label >= model.config.num_labels:
            raise ValueError(
                f"RewardModel label {self.label} is out of range: {self.model_name} has "
                f"num_labels={model.config.num_labels}"
            )
        self._model = model.eval()

    def text(self, prompt, completion) -> str:
        """The text scored for one sample (see the class docstring); ``completion`` is text or, with chat
        prompts, the messages after the prompt (as ``RewardSet`` passes them)."""
        return self._rendered(prompt, completion)[0]

    def token_ids(self, prompt, completion) -> list[int]:
        """The token ids scored for one sample, before truncation (see the class docstring)."""
        if self.pair:
            if not isinstance(prompt, str):
                raise ValueError(
                    f"RewardModel {self.model_name} has pair=True, which scores (prompt, completion) text pairs, but "
                    f"a prompt is a list of chat messages ({prompt!r}); give text prompts, or pair=False"
                )
            return list(self._loaded_tokenizer()(prompt, completion_text(completion))["input_ids"])
        text, templated = self._rendered(prompt, completion)
        return list(self._tokenizer(text, add_special_tokens=not templated)["input_ids"])

    def _loaded_tokenizer(self):
        if self._model is None:
            self._load()
        return self._tokenizer

    def _rendered(self, prompt, completion) -> tuple[str, bool]:
        """The text scored and whether the chat template wrote it."""
        self._loaded_tokenizer()
        if isinstance(prompt, str):
            return prompt + completion_text(completion), False
        reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        if self._tokenizer.chat_template is not None:
            return self._tokenizer.apply_chat_template([*prompt, *reply], tokenize=False), True
        return "".join(m["content"] for m in [*prompt, *reply]), False

    def __call__(self, prompts: list, completions: list[str], **columns) -> list[float]:
        rows = self._truncated([self.token_ids(p, c) for p, c in zip(prompts, completions)])
        scores = []
        with torch.no_grad():
            for start in range(0, len(rows), self.batch_size):
                scores += self._scores(rows[start : start + self.batch_size])
        return scores

    def _truncated(self, rows: list[list[int]]) -> list[list[int]]:
        limit = self.max_length or self._tokenizer.model_max_length
        long = sum(len(row) > limit for row in rows)
        if long:
            warnings.warn(
                f"RewardModel {self.model_name}: {long} of {len(rows)} texts are longer than max_length {limit} "
                f"tokens (the longest {max(map(len, rows))}); each is scored on its first {limit} tokens, so its "
                "reward reads a cut text",
                stacklevel=3,
            )
        return [row[:limit] for row in rows]

    def _scores(self, rows: list[list[int]]) -> list[float]:
        """One forward over right-padded rows. The model reads its score at the rightmost token that is not its
        ``pad_token_id``, so the pad used here is one no row ends with."""
        pad = padding_id(rows, self._tokenizer.pad_token_id)
        length = max(map(len, rows))
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        config = self._model.config.get_text_config()
        loaded, config.pad_token_id = config.pad_token_id, pad
        try:
            device = self._model.device  # where "cuda" put it: the loading thread's current GPU
            logits = self._model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
            ).logits.float()
        finally:
            config.pad_token_id = loaded
        return logits[:, self.label].tolist()


def is_sequence_classifier(fn) -> bool:
    """Whether a reward function given is a sequence-classification model (TRL's ``reward_funcs`` takes one)."""
    return isinstance(fn, nn.Module) and isinstance(getattr(getattr(fn, "config", None), "num_labels", None), int)


def padding_id(rows: list[list[int]], preferred: int | None) -> int:
    """A pad id that is not the last token of any row: ``preferred`` (the tokenizer's pad) when none ends with it,
    else the smallest id none ends with."""
    last = {row[-1] for row in rows if row}
    if preferred is not None and preferred not in last:
        return preferred
    return next(i for i in range(len(last) + 1) if i not in last)
