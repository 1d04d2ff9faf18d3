"""The closed vocabulary of the embedded shapes world: shapes, colours, numbers, relations and prompt words.

Everything that appears in a shapes prompt is a word of ``WORDS``; the text encoder of ``shapes-dit`` embeds these
ids. Colours are far apart in RGB so that the rule-based detector can classify anti-aliased pixels reliably.
"""

from __future__ import annotations

import re

import torch

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURALS: dict[str, str] = {s: s + "s" for s in SHAPES}
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 195, 25),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
NUMBERS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

PAD, UNK = 0, 1
MAX_TOKENS = 16
_FILLER = ("a", "an", "photo", "of", "and", "left", "right", "above", "below")
WORDS: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    *_FILLER,
    *SHAPES,
    *PLURALS.values(),
    *COLORS,
    *NUMBERS.values(),
)
WORD_IDS: dict[str, int] = {w: i for i, w in enumerate(WORDS)}
_SPLIT = re.compile(r"[a-z]+")


def words(prompt: str) -> list[str]:
    """Lower-cased words of a prompt, punctuation dropped."""
    return _SPLIT.findall(prompt.lower())


def tokenize(prompts: list[str], max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Word ids [N, max_tokens] (long, PAD-padded) and a bool mask [N, max_tokens] of real tokens.

    Words outside the vocabulary map to UNK; prompts longer than ``max_tokens`` words are truncated.
    """
    ids = torch.full((len(prompts), max_tokens), PAD, dtype=torch.long, device="cpu")  # the backbone moves them
    for row, prompt in enumerate(prompts):
        tokens = [WORD_IDS.get(w, UNK) for w in words(prompt)][:max_tokens]
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device="cpu")
    return ids, ids != PAD


def prompt_warnings(prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """One warning per kind of loss ``tokenize`` would make silently: words outside ``WORDS`` (they become
    ``<unk>``, which the model never saw in training) and prompts cut at ``max_tokens`` words. Every command that
    samples a user's prompt (``tpflow sample``, ``inspect-trajectory``, ``eval --prompts FILE``) prints these."""
    unknown = dict.fromkeys(w for p in prompts for w in words(p) if w not in WORD_IDS)
    long = [p for p in prompts if len(words(p)) > max_tokens]
    out = []
    if unknown:
        known = ", ".join(w for w in WORDS if not w.startswith("<"))
        out.append(
            f"{', '.join(repr(w) for w in unknown)} {'is' if len(unknown) == 1 else 'are'} not in the shapes world's "
            f"vocabulary and become <unk>, a token the model never saw in training (docs/shapes.md, 'Vocabulary'). "
            f"Its words: {known}."
        )
    if long:
        out.append(f"{len(long)} prompt(s) have more than {max_tokens} words and are cut there, e.g. {long[0]!r}.")
    return out
