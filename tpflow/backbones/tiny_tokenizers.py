"""Tokenizers built in code for the tiny SD3 / FLUX backbones: no file, no download (docs/architecture.md, "Real
models at test size, offline").

* CLIP: a byte-level BPE from the real CLIP merges file that open_clip ships (``bpe_simple_vocab_16e6.txt.gz``).
  The vocabulary is built the way CLIP builds it (256 byte symbols, the same with ``</w>``, one token per merge,
  then the two special tokens), so the first 486 merges give exactly 1,000 ids.
* Qwen2 (Qwen-Image's Qwen2.5-VL): byte-level BPE over the 256 byte symbols, no merges, plus the chat template's
  special tokens: every text tokenizes, one id per byte.
* T5: a SentencePiece-style Unigram over an in-memory piece list (letters, digits, punctuation and a few words),
  so every prompt tokenizes without unknown pieces.

Gotcha kept here once: in transformers 5, ``CLIPTokenizer(vocab_file=..., merges_file=...)`` silently ignores both
files; the vocabulary and merges are passed as ``vocab=`` / ``merges=`` and the size is asserted.
"""

from __future__ import annotations

import gzip
import string
from functools import lru_cache
from importlib import resources

CLIP_MERGES = 486  # merges kept: 512 byte symbols + 486 merges + 2 specials = 1,000 ids
CLIP_VOCAB_SIZE = 1000
QWEN_VOCAB_SIZE = 259  # 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|>
T5_WORDS = (
    "a an the of and photo on in with is at to red green blue yellow orange purple pink brown black white cat dog "
    "car sign says text that"
).split()


def _bytes_to_unicode() -> list[str]:
    """CLIP/GPT-2's reversible map of the 256 bytes to printable characters, in CLIP's vocabulary order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


@lru_cache(maxsize=1)
def _clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    path = resources.files("open_clip") / "bpe_simple_vocab_16e6.txt.gz"
    with resources.as_file(path) as file, gzip.open(file, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")[1 : CLIP_MERGES + 1]  # line 0 is a version header
    merges = [tuple(line.split()) for line in lines]
    symbols = _bytes_to_unicode()
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges  # type: ignore[return-value]


def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """A CLIPTokenizer with 1,000 ids and CLIP's 77-token limit (SD3's second tokenizer pads with ``!``)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges()
    tokenizer = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=pad_token, model_max_length=77)
    assert len(tokenizer) == CLIP_VOCAB_SIZE, f"tiny CLIP tokenizer has {len(tokenizer)} ids, expected 1000"
    return tokenizer


def t5_tokenizer():
    """A T5Tokenizer (Unigram) over letters, digits, punctuation and a few words; no sentinel ids."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -3.0) for w in T5_WORDS]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [("▁" + c, -5.0) for c in chars] + [(c, -6.0) for c in chars]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    assert len(tokenizer) == len(pieces), f"tiny T5 tokenizer has {len(tokenizer)} ids, expected {len(pieces)}"
    return tokenizer


def qwen_tokenizer():
    """A Qwen2Tokenizer: byte-level BPE with the 256 byte symbols and no merges (one token per byte), plus the chat
    template's special tokens, so QwenImagePipeline's template and any prompt tokenize."""
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert len(tokenizer) == QWEN_VOCAB_SIZE, f"tiny Qwen tokenizer has {len(tokenizer)} ids, expected 259"
    return tokenizer
