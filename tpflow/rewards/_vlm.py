"""Helpers of the ``vlm-judge`` reward: its questions (one image, a pair), the parsing of a judge's answer, the
pixel budget.

Kept apart from the reward so that each can be tested without a model (the parser on strings, the resize on
tensors).
"""

from __future__ import annotations

import math
import re

from torch import Tensor

from tpflow.images import clip_preprocess, to_uint8

# The pointwise text-to-image question of UnifiedReward (Wang et al., arXiv 2503.05236), verbatim from its public
# inference script for the Qwen2.5-VL judges (github.com/CodeGoat24/UnifiedReward, commit ed52f98,
# inference_qwen/image_generation/qwen_point_score_image_generation.py). The judge answers with the caption's
# elements, one "element (type): 0 or 1" per line, then "Final Score: " and its score; the reward's default.
UNIFIED_REWARD_TEMPLATE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail preservation, "
    "color accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image using the "
    "format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and assign a "
    "score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\n"
    "Text Caption: [{prompt}]"
)

# tpflow's shorter rewording of that question (the option question = "score-only"): the same two criteria, the same
# 1-5 scale, the same "Final Score:" answer format and "Text Caption: [...]" slot, but no element list, so that the
# answer can be started for the judge with "Final Score: " and the score read in one forward pass. UnifiedReward's
# judges were fine-tuned on the question above; on this one they are used off their protocol, and may score the same
# images differently.
SCORE_ONLY_TEMPLATE = (
    "You are given a text caption and an image generated from it. Evaluate the image on two criteria:\n"
    "1. Alignment with the caption: how faithfully the image shows the objects, their attributes and their "
    "relations as the caption describes them.\n"
    "2. Overall image quality: clarity, detail, colour and aesthetic appeal.\n"
    "Assign a score from 1 to 5 after 'Final Score:'.\n"
    "Text Caption: [{prompt}]"
)

# The editing question (the option question = "edit"): the judge is shown the source image, then the edited one, and
# rates the edit on the two criteria editing judges use, following the instruction and keeping the rest as it was
# (VIEScore's semantic consistency and over-editing, Ku et al., arXiv 2312.14867), on the same 1-5 scale and answer
# format as the questions above, the answer started with "Final Score: " (one forward pass).
EDIT_TEMPLATE = (
    "You are given an image editing instruction and two images: the first is the source image, the second is the "
    "result of editing it. Evaluate the edit on two criteria:\n"
    "1. Instruction following: how well the second image carries out the instruction.\n"
    "2. Preservation: how well everything the instruction does not ask to change (the other objects, the layout, "
    "the colours, the identity and the style) stays as it is in the source image.\n"
    "Assign a score from 1 to 5 after 'Final Score:'.\n"
    "Instruction: [{prompt}]"
)

# (question, the start of the judge's answer given to it) of each value of the reward's option ``question``.
QUESTIONS = {
    "unifiedreward": (UNIFIED_REWARD_TEMPLATE, ""),
    "score-only": (SCORE_ONLY_TEMPLATE, "Final Score: "),
    "edit": (EDIT_TEMPLATE, "Final Score: "),
}

# The pixel budget of UnifiedReward's script: qwen_vl_utils' ``fetch_image`` (called by ``process_vision_info``)
# resizes each image to multiples of 28 within [MIN_PIXELS, MAX_PIXELS] = [4·28², 16384·28²] (QwenLM/Qwen2.5-VL,
# qwen-vl-utils/src/qwen_vl_utils/vision_process.py); the processor's own resize then leaves the size as it is.
QWEN_VL_MAX_PIXELS = 16384 * 28 * 28

# The pairwise text-to-image question of UnifiedReward's Qwen2.5-VL judges (its public script
# inference_qwen/image_generation/qwen_pair_rank_image_generation.py), reworded: two images of one caption, the same
# two criteria as the pointwise question, the caption in the same "Text Caption: [...]" slot, and the conclusion
# "Image 1 is better." or "Image 2 is better." that the judge was fine-tuned to write. The upstream question also
# offers a tie ("Both images are equally good."); it is left out, because the reward reads only the tokens "1" and
# "2" after the answer prefix "Image ", and a judge that cannot tell the two apart puts about equal mass on both.
DEFAULT_PAIR_TEMPLATE = (
    "You are given a text caption and two images generated from it, Image 1 and Image 2. Compare the two images on "
    "two criteria:\n"
    "1. Alignment with the caption: how faithfully each image shows the objects, their attributes and their "
    "relations as the caption describes them.\n"
    "2. Overall image quality: clarity, detail, colour and aesthetic appeal.\n"
    'Pick the image that fits the caption better while looking better, and conclude with "Image 1 is better." or '
    '"Image 2 is better."\n'
    "Text Caption: [{prompt}]"
)

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(text: str, low: float, high: float, marker: str = "") -> float | None:
    """The score a judge's answer gives: the first number after the last ``marker`` (case is ignored), or with no
    marker the first number of the answer; None when there is none, when the answer lacks the marker, or when the
    number lies outside [low, high].

    "Score: 4" -> 4, "4/5" -> 4, "I'd say 3.5" -> 3.5, "none" -> None; with the scale 1-5, "10" -> None: a number
    off the scale is not a score on it, and reading it as one would reward a confused judge. With the marker
    "Final Score:", "cat (object): 1" -> None: an answer cut off before its score is not scored by its element list
    (UnifiedReward's own readers, e.g. flow_grpo's, match "Final Score:" or score nothing).
    """
    if marker:
        at = text.lower().rfind(marker.lower())
        if at < 0:
            return None
        text = text[at + len(marker) :]
    found = _NUMBER.search(text)
    if found is None:
        return None
    value = float(found.group())
    return value if math.isfinite(value) and low <= value <= high else None


def budget_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) of an image resized for a Qwen-VL vision tower: multiples of ``factor`` (patch size × merge size),
    the aspect ratio kept, the area within [min_pixels, max_pixels] (Qwen2-VL's ``smart_resize`` rule)."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def judge_pixels(images: Tensor, size: tuple[int, int]) -> Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 3, h, w] uint8 (the device of ``images``) resized to ``size``.

    Quantised to 8 bits first, as the reference judges PIL images, and resized image by image with PIL's
    antialiased bicubic (``clip_preprocess``, squashed to the size): a score never depends on the rest of the batch.
    """
    x = clip_preprocess(images, max(size), size, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), squash=True)  # [N, 3, h, w]
    return to_uint8(x)
