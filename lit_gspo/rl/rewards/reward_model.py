"""A learned reward: a sequence-classification model scores each (prompt, completion)."""

from __future__ import annotations

import torch

from lit_gspo.rl.rewards.calling import completion_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModel:
    """reward_i = logit_label(RM(prompt_i ⊕ completion_i)) with ``AutoModelForSequenceClassification``.

    The text scored is the conversation when the prompt is a list of chat messages and the reward
    model's tokenizer has a chat template (the completion appended as the assistant's turn), and
    ``prompt + completion`` otherwise. Texts are scored in batches of ``batch_size``, right-truncated
    to ``max_length`` tokens, in eval mode without gradient. The model loads on the first call, so a
    config names it without loading it.

    Args:
        model: a local directory or hub id of a sequence-classification model (with its tokenizer).
        label: which output logit is the reward (0 for the usual single-logit reward model).
        batch_size: texts per forward.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, …; None: CUDA when available, else CPU.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (the scores are returned as Python floats).
        max_length: longest text in tokens (None: the tokenizer's ``model_max_length``).
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(
        self,
        model: str,
        label: int = 0,
        batch_size: int = 16,
        device: str | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        weight: float = 1.0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"RewardModel dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"RewardModel batch_size must be >= 1, got {batch_size}")
        if label < 0:
            raise ValueError(f"RewardModel label must be >= 0, got {label}")
        self.model_name, self.label, self.batch_size = model, label, batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype, self.max_length, self.weight = dtype, max_length, weight
        self._model = self._tokenizer = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        model = AutoModelForSequenceClassification.from_pretrained(self.model_name, dtype=DTYPES[self.dtype])
        if model.config.pad_token_id is None:  # batched scoring finds each row's last token through the pad id
            model.config.pad_token_id = self._tokenizer.pad_token_id
        if self.label >= model.config.num_labels:
            raise ValueError(
                f"RewardModel label {self.label} is out of range: {self.model_name} has "
                f"num_labels={model.config.num_labels}"
            )
        self._model = model.to(self.device).eval()

    def text(self, prompt, completion) -> str:
        """The text scored for one sample (see the class docstring); ``completion`` is text or, with chat
        prompts, the messages after the prompt (as ``RewardSet`` passes them)."""
        if isinstance(prompt, str):
            return prompt + completion_text(completion)
        reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        if self._tokenizer.chat_template is not None:
            return self._tokenizer.apply_chat_template([*prompt, *reply], tokenize=False)
        return "".join(m["content"] for m in [*prompt, *reply])

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list[str], **columns) -> list[float]:
        if self._model is None:
            self._load()
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        tok = self._tokenizer
        side, tok.padding_side = tok.padding_side, "right"  # the model reads its score at the last real token
        try:
            scores = []
            for start in range(0, len(texts), self.batch_size):
                batch = tok(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=False,
                ).to(self.device)
                logits = self._model(**batch).logits.float()
                scores += logits[:, self.label].tolist()
        finally:
            tok.padding_side = side
        return scores
