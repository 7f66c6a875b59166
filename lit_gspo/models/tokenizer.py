"""A character-level tokenizer for the built-in tiny models and synthetic tasks.

Every character is one token, so the vocabulary is small (~100 ids) and tokenisation is
predictable in tests. It needs no download. There is deliberately **no chat template**: the
synthetic tasks feed raw prompts, and code that wants chat formatting must check
``tokenizer.chat_template`` first (it is ``None`` here).
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PUNCTUATION = "+-*/=?:,.;!()[]<>'\"_#"
CHARACTERS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + PUNCTUATION


def char_vocab() -> dict[str, int]:
    """Return the token → id map: the special tokens first (pad=0, bos=1, eos=2, unk=3), then the characters."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level ``PreTrainedTokenizerFast`` (pad ``<pad>`` ≠ eos ``<eos>``, no chat template).

    Unknown characters map to ``<unk>``. ``decode`` joins characters back without separators,
    so ``decode(encode(text)) == text`` for text made of the covered characters. The tokenizer
    does not add ``<bos>``/``<eos>`` automatically; callers append eos to targets if they want it.
    It round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    backend = Tokenizer(WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Split into single characters; isolated so nothing (spaces, newlines) is dropped.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tok
