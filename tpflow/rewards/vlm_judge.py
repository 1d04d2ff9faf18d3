"""Reward ``vlm-judge``: a vision-language model asked to rate each image for its prompt, as UnifiedReward (Wang et
al., arXiv 2503.05236) scores text-to-image samples with its fine-tuned Qwen2.5-VL judges.

    [reward]
    name = "vlm-judge"
    model = "CodeGoat24/UnifiedReward-qwen-7b"   # a Hugging Face id already cached, or a folder (save_pretrained)
    score_from = "logits"                         # or "answer"
    batch_size = 8

The judge is any transformers image-text-to-text model of the Qwen-VL family (Qwen2-VL, Qwen2.5-VL) with its
processor and chat template; it is shown the image and a question (``{prompt}`` replaced by the prompt). By default
it is used by its own protocol, that of UnifiedReward's inference script
(``inference_qwen/image_generation/qwen_point_score_image_generation.py``): ``question = "unifiedreward"`` asks
UnifiedReward's question verbatim, the judge writes its answer (the caption's elements, "element (type): 0 or 1"
line by line, then "Final Score: " and the score), and the image is resized within the script's pixel budget,
16384·28² (qwen_vl_utils' ``MAX_PIXELS``). ``question = "score-only"`` asks tpflow's shorter rewording (same
criteria and scale, no element list) and starts the answer with "Final Score: ", so that the score is read in one
forward pass: cheaper, but off the judge's protocol, so it may score the same images differently. ``template`` and
``answer_prefix`` override the question's. Two ways to read the score:

* ``score_from = "logits"`` (the default): the expected value of the digits ``scale_min`` .. ``scale_max`` under
  the softmax of their logits at the position where the score is written, a continuous score that separates
  images the judge would both answer "4" for. With the default question the judge first writes greedily, at most
  ``max_new_tokens`` tokens, up to ``answer_marker`` ("Final Score:"); one more forward pass over what it wrote
  plus a space gives the digits' logits. An answer that reaches ``max_new_tokens`` without the marker gets it
  appended (marked in the detail ``vlm_judge_no_marker`` and counted in a warning). When ``answer_prefix`` ends
  with the marker (``question = "score-only"``) nothing is generated: one forward pass. The detail
  ``vlm_judge_token_mass`` is the probability the judge puts on those digits at all (low: the question or prefix
  does not lead it to answer with a digit there).
* ``score_from = "answer"``: greedy generation of ``max_new_tokens`` tokens, parsed by ``_vlm.parse_score`` (the
  first number after the last ``answer_marker``, in ``answer_prefix`` and the answer), as UnifiedReward's users
  read "Final Score: N" off the generated text. An answer with no number on the scale after the marker scores
  ``fallback_score`` (default: the scale's minimum, so that failing to answer never pays), is marked in the detail
  ``vlm_judge_unparsed`` and counted in a warning; it never stops training.

Measured on the tiny random Qwen2.5-VL of the tests (2 text layers of width 32, a one-block vision tower; CPU,
float32, one thread, 16 images of 128×128 px judged at 112×112 in batches of 8, median of 5 runs), with
``question = "score-only"``: ``logits`` 4.9 ms per image, ``answer`` with 8 new tokens 12.1 ms per image. With the
default question both modes also decode the element list, one step per token (docs/rewards.md estimates the cost).

**Edits.** ``question = "edit"`` judges an edited image against its prompt's source (``metadata["sources"]``, the
first, brought to the edit's size): the chat shows the source, then the edit, then ``_vlm.EDIT_TEMPLATE`` (the
instruction, how well it is followed and how well the rest is kept), the answer started with "Final Score: ".

Score = (s - scale_min) / (scale_max - scale_min), in [0, 1]; the raw s is the detail ``vlm_judge_score``. Images
are quantised to 8 bits and resized to multiples of the vision tower's patch × merge size within ``max_pixels`` and
the processor's own maximum (``_vlm.judge_pixels``), prompts left-padded within a batch of ``batch_size``. Weights
are never downloaded.

**Pairs.** ``compare(images_a, images_b, prompts, metadata)`` asks the judge which of two images of one prompt is
better (``tpflow.rewards.pairwise.PairwiseJudge``), as Pref-GRPO (arXiv 2508.20751) asks UnifiedReward: both images
in one chat, image a first, then ``pair_template`` (by default UnifiedReward's pairwise image-generation question,
reworded), the answer started with ``pair_answer_prefix`` ("Image "); P(a better) is the softmax over the logits of
the two ``pair_answers`` ("1", "2") only, at the answer position: one forward pass per ``batch_size // 2`` pairs
(a pair row holds two images), in every ``score_from`` mode. It is the raw probability for the order shown; the
``pairwise`` reward judges both orders and averages them, which cancels the judge's bias for the first image::

    [reward]
    name = "pairwise"
    judge = { name = "vlm-judge", options = { model = "CodeGoat24/UnifiedReward-qwen-7b" } }
    judge_batch = 16

Why a method of ``vlm-judge`` rather than a sibling reward: it is the same judge (same weights, processor, pixel
budget, device, one load serving both questions), and ``pairwise`` picks the question from the class, so naming
``vlm-judge`` as the judge now gets Pref-GRPO's pairwise judgement with no second reward whose single-image scores
would duplicate this one's. The scalar route (each image rated once, the ratings compared: G passes per group
instead of G(G − 1)) stays open through a served judge, ``judge = { name = "remote", options = { url = "...",
reward = "vlm-judge" } }``, which sends single images.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards._vlm import (
    DEFAULT_PAIR_TEMPLATE,
    QUESTIONS,
    QWEN_VL_MAX_PIXELS,
    budget_size,
    judge_pixels,
    parse_score,
)
from tpflow.rewards.edit_features import first_source, source_at
from tpflow.sources import load
from tpflow.types import RewardOutput
from tpflow.weights import MODEL_FILES, WeightSource, download_command, model_folder

logger = logging.getLogger(__name__)

UNIFIED_REWARD = "CodeGoat24/UnifiedReward-qwen-7b"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_WHAT = "reward 'vlm-judge' model (option model)"
_HOW = "set the option to a local folder written by save_pretrained (the model with its processor)"
_NEEDS = [
    ("config.json",),
    MODEL_FILES,
    ("preprocessor_config.json", "processor_config.json"),
    ("tokenizer.json", "vocab.json"),
]


class VLMJudgeOptions(BaseModel):
    """Options of the VLM judge reward."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(UNIFIED_REWARD, description="Judge: a cached Hugging Face id or a local folder.")
    question: Literal["unifiedreward", "score-only", "edit"] = Field(
        "unifiedreward",
        description="\"unifiedreward\": UnifiedReward's own question, the judge lists the caption's elements "
        'before its score; "score-only": a shorter rewording, answer started with "Final Score: "; "edit": the '
        "prompt's source image shown before the edit, rated on following the instruction and keeping the rest.",
    )
    template: str | None = Field(None, description="Question; {prompt} is the image's prompt. None: question's.")
    answer_prefix: str | None = Field(None, description="Start of the judge's answer, given. None: question's.")
    score_from: Literal["logits", "answer"] = Field("logits", description="Score digits' logits, or parsed answer.")
    scale_min: int = Field(1, ge=0, le=9, description="Lowest score (a digit).")
    scale_max: int = Field(5, ge=0, le=9, description="Highest score (a digit).")
    max_new_tokens: int = Field(512, ge=1, description="Most tokens the judge writes (UnifiedReward's script: 512).")
    answer_marker: str = Field("Final Score:", description="The score follows it (written, or in answer_prefix).")
    fallback_score: float | None = Field(None, description="Answer mode, no score found; None: scale_min.")
    batch_size: int = Field(8, ge=1, description=option_help.BATCH_SIZE)
    max_pixels: int = Field(QWEN_VL_MAX_PIXELS, ge=1, description=option_help.MAX_PIXELS)
    pair_template: str = Field(DEFAULT_PAIR_TEMPLATE, description="Pairs: question; {prompt} is their prompt.")
    pair_answer_prefix: str = Field("Image ", description="Pairs: start of the judge's answer, given.")
    pair_answers: tuple[str, str] = Field(("1", "2"), description="Pairs: the tokens naming image a and b.")
    device: str = Field("auto", description=option_help.DEVICE)
    dtype: Literal["float32", "float16", "bfloat16"] = Field("bfloat16", description=option_help.DTYPE)

    @model_validator(mode="after")
    def _check(self) -> VLMJudgeOptions:
        template, prefix = QUESTIONS[self.question]
        self.template = template if self.template is None else self.template
        self.answer_prefix = prefix if self.answer_prefix is None else self.answer_prefix
        if self.scale_min >= self.scale_max:
            raise ValueError(f"scale_min ({self.scale_min}) must be below scale_max ({self.scale_max}).")
        if "{prompt}" not in self.template:
            raise ValueError("template must contain {prompt}, where the image's prompt goes.")
        if "{prompt}" not in self.pair_template:
            raise ValueError("pair_template must contain {prompt}, where the pair's prompt goes.")
        if not all(self.pair_answers) or self.pair_answers[0] == self.pair_answers[1]:
            raise ValueError(f"pair_answers {list(self.pair_answers)} must be two different non-empty tokens.")
        fallback = self.fallback_score
        if fallback is not None and not self.scale_min <= fallback <= self.scale_max:
            raise ValueError(f"fallback_score {fallback} is outside the scale {self.scale_min}-{self.scale_max}.")
        return self


@register("reward", "vlm-judge", options=VLMJudgeOptions)
class VLMJudgeReward:
    """RewardModel: a VLM judge's score of each image for its prompt, in [0, 1]; ``scores`` [N] float32 on the CPU.
    Also a ``PairwiseJudge``: ``compare`` gives P(a better) of two images of one prompt (``pairwise``'s judge).

    The model and processor load on the first call (or ``load()``), once, under a lock: the reward may be built
    without weights and called from the scoring thread. ``details``: ``vlm_judge_score`` (raw, on the judge's scale)
    and ``vlm_judge_token_mass`` (logits mode; with ``vlm_judge_no_marker`` when the judge writes first, 1 where it
    wrote no marker) or ``vlm_judge_unparsed`` (answer mode, 1 where the fallback scored).
    """

    @staticmethod
    def weight_sources(options: VLMJudgeOptions, settings: dict) -> list[WeightSource]:
        """Where the judge will be read from (a local folder or a Hugging Face cache snapshot, with its processor
        files), found without the network (``tpflow.weights``)."""
        return [model_folder(_WHAT, options.model, _NEEDS, _HOW)]

    def __init__(self, options: VLMJudgeOptions | None = None):
        self.options = options or VLMJudgeOptions()
        self.device = resolve_device(self.options.device)  # in the building thread, on its current GPU
        self._lock = threading.Lock()
        self._model: Any = None
        self._processor: Any = None
        self._digit_ids: list[int] = []
        self.unparsed = 0  # answers that gave no score (or, logits mode, no marker) over this instance's life

    def load(self) -> None:
        """Load the judge and its processor now (the first call does it otherwise)."""
        with self._lock:
            if self._model is not None:
                return
            (source,) = self.weight_sources(self.options, {})
            if source.problem or source.path is None:
                raise UserError(source.problem or f"{_WHAT}: {self.options.model!r} was not found.")
            from transformers import AutoModelForImageTextToText, AutoProcessor

            try:
                processor = AutoProcessor.from_pretrained(source.path, local_files_only=True)
                model = AutoModelForImageTextToText.from_pretrained(
                    source.path, local_files_only=True, dtype=_DTYPES[self.options.dtype]
                )
            except (OSError, ValueError, KeyError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(
                    f"{_WHAT}: {self.options.model!r} could not be loaded from {source.path}: {reason}. Fetch it "
                    f"again with {download_command(self.options.model)}, or {_HOW}."
                ) from None
            processor.tokenizer.padding_side = "left"  # the answer position is the last one of every row
            self._digit_ids = self._score_token_ids(processor.tokenizer)
            self._processor = processor
            self._model = model.eval().requires_grad_(False).to(self.device)

    def _score_token_ids(self, tokenizer: Any) -> list[int]:
        """Token ids of the digits scale_min .. scale_max; each must be one token (Qwen's tokenizers split numbers
        into single digits, so it is)."""
        ids = []
        for digit in range(self.options.scale_min, self.options.scale_max + 1):
            encoded = tokenizer.encode(str(digit), add_special_tokens=False)
            if len(encoded) != 1:
                raise UserError(
                    f"reward 'vlm-judge': the judge's tokenizer splits the score {digit} into {len(encoded)} tokens; "
                    'score_from = "logits" needs one token per digit. Use score_from = "answer".'
                )
            ids.append(encoded[0])
        return ids

    def texts(self, prompts: Sequence[str], pair: bool = False) -> list[str]:
        """The judge's input text of each prompt: its chat template around the image (the source then the edit with
        ``question = "edit"``; with ``pair``, the pair's two images) and the question, then the start of the answer."""
        o = self.options
        template, prefix = (o.pair_template, o.pair_answer_prefix) if pair else (o.template, o.answer_prefix)
        images = 2 if pair or o.question == "edit" else 1
        texts = []
        for prompt in prompts:
            question = template.replace("{prompt}", prompt)
            content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
            messages = [{"role": "user", "content": content}]
            chat = self._processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            texts.append(chat + prefix)
        return texts

    def _pixels(self, images: Tensor) -> Tensor:
        """Images [n, 3, H, W] in [0, 1] -> [n, 3, h, w] uint8 on the CPU, resized within the pixel budget: the
        option's and the processor's own (which UnifiedReward's script, calling the processor with its resize on,
        applies after its own)."""
        ip = self._processor.image_processor
        size = ip.size if isinstance(ip.size, dict) else vars(ip.size)
        min_pixels = size.get("shortest_edge") or getattr(ip, "min_pixels", None) or 56 * 56
        most = size.get("longest_edge") or getattr(ip, "max_pixels", None)
        max_pixels = min(self.options.max_pixels, most) if most else self.options.max_pixels
        factor = ip.patch_size * ip.merge_size
        target = budget_size(*images.shape[-2:], factor, min(min_pixels, max_pixels), max_pixels)
        return judge_pixels(images, target).cpu()

    def _batch(self, texts: list[str], pixels: list[Tensor]) -> Any:
        """The processor's batch (ids left-padded, pixel patches, grids) on the model's device; ``pixels`` in the
        order their images appear in ``texts``."""
        batch = self._processor(text=texts, images=pixels, padding=True, do_resize=False, return_tensors="pt")
        return batch.to(self._model.device)

    def inputs(self, images: Tensor, prompts: Sequence[str], written: Sequence[str] | None = None) -> Any:
        """The processor's batch of images [n, 3, H, W] and their prompts, one image per row; ``written``: what each
        row's judge wrote after ``answer_prefix`` (``up_to_marker``), appended."""
        texts = self.texts(prompts)
        if written is not None:
            texts = [text + more for text, more in zip(texts, written, strict=True)]
        return self._batch(texts, list(self._pixels(images)))

    def _shown(self, images: Tensor, metadata: Sequence[dict[str, Any]]) -> list[Tensor]:
        """The judge's pixels of images [n, 3, H, W] in the order the texts show them: each image, or with
        ``question = "edit"`` its prompt's first source (at the edit's size, ``edit_features.source_at``) first."""
        pixels = list(self._pixels(images))
        if self.options.question != "edit":
            return pixels
        size = (int(images.shape[-2]), int(images.shape[-1]))
        shown = [source_at(load(first_source(m, "reward 'vlm-judge' (question = \"edit\")")), size) for m in metadata]
        return [image for pair in zip(self._pixels(torch.stack(shown)), pixels, strict=True) for image in pair]

    @property
    def writes_first(self) -> bool:
        """Whether, in logits mode, the judge writes before its score: ``answer_prefix`` does not end with
        ``answer_marker`` (UnifiedReward's question: it lists the caption's elements first)."""
        return not self.options.answer_prefix.rstrip().endswith(self.options.answer_marker.rstrip())

    def up_to_marker(self, answers: Sequence[str]) -> tuple[list[str], Tensor]:
        """What each judge wrote, cut just after the first ``answer_marker`` and followed by a space (the judge
        writes "Final Score: 4"), and [n] float64, 1 where an answer has no marker: it is then appended to the
        answer on a line of its own."""
        marker = self.options.answer_marker
        written, missing = [], []
        for answer in answers:
            at = answer.find(marker)
            if at >= 0:
                written.append(answer[: at + len(marker)] + " ")
            else:
                written.append((answer.rstrip() + "\n" if answer.strip() else "") + marker + " ")
            missing.append(float(at < 0))
        return written, torch.tensor(missing, dtype=torch.float64, device="cpu")

    def pair_inputs(self, images_a: Tensor, images_b: Tensor, prompts: Sequence[str]) -> Any:
        """The processor's batch of pairs: row i shows images_a[i], then images_b[i] [n, 3, H, W] each, and asks
        ``pair_template`` about prompts[i]."""
        if images_a.shape != images_b.shape:
            raise ValueError(f"Pairs of images of shapes {tuple(images_a.shape)} and {tuple(images_b.shape)}.")
        pixels_a, pixels_b = self._pixels(images_a), self._pixels(images_b)  # [n, 3, h, w] uint8 each
        pixels = [image for pair in zip(pixels_a, pixels_b, strict=True) for image in pair]  # a0, b0, a1, b1, ...
        return self._batch(self.texts(prompts, pair=True), pixels)

    def _pair_token_ids(self) -> list[int]:
        """Token ids of the two ``pair_answers``; each must be one token."""
        ids = []
        for answer in self.options.pair_answers:
            encoded = self._processor.tokenizer.encode(answer, add_special_tokens=False)
            if len(encoded) != 1:
                raise UserError(
                    f"reward 'vlm-judge': the judge's tokenizer splits the pair answer {answer!r} into "
                    f"{len(encoded)} tokens; compare reads one token per answer. Set pair_answers to single tokens."
                )
            ids.append(encoded[0])
        return ids

    @torch.no_grad()
    def compare(
        self, images_a: Tensor, images_b: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> Tensor:
        """P(a better) [N] float64 on the CPU for N pairs, images_a, images_b [N, 3, H, W] in [0, 1] of prompts [N]:
        the softmax over the two ``pair_answers``' logits at the answer position, the first's share. Image a is
        shown first; the ``pairwise`` reward averages both orders."""
        if not len(images_a) == len(images_b) == len(prompts):
            raise ValueError(f"Got {len(images_a)} and {len(images_b)} images for {len(prompts)} prompts.")
        self.load()
        ids = torch.tensor(self._pair_token_ids(), dtype=torch.long, device="cpu")
        step = max(1, self.options.batch_size // 2)  # a pair row holds two images
        out: list[Tensor] = []
        for start in range(0, len(prompts), step):
            chunk = slice(start, start + step)
            batch = self.pair_inputs(images_a[chunk], images_b[chunk], prompts[chunk])
            logits = self._model(**batch, logits_to_keep=1).logits[:, -1].double().cpu()  # [n, V] answer position
            out.append(logits[:, ids].softmax(-1)[:, 0])  # [n]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device="cpu")

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32 in [0, 1]."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        self.load()
        o = self.options
        lo, hi, size = o.scale_min, o.scale_max, o.batch_size
        logits = o.score_from == "logits"
        raw: list[Tensor] = []
        other: list[Tensor] = []
        flags: list[Tensor] = []  # 1 where the judge gave no score of its own (no marker, or unparsed)
        for start in range(0, len(prompts), size):
            chunk = slice(start, start + size)
            texts, pixels = self.texts(prompts[chunk]), self._shown(images[chunk], metadata[chunk])
            if logits and self.writes_first:
                answers = self._generate(self._batch(texts, pixels), stop=o.answer_marker or None)
                written, missing = self.up_to_marker(answers)
                texts = [text + more for text, more in zip(texts, written, strict=True)]
                flags.append(missing)
            if logits:
                score, mass = self._from_logits(self._batch(texts, pixels))
                raw.append(score)
                other.append(mass)
            else:
                score, unparsed = self._from_answer(self._generate(self._batch(texts, pixels), stop=None))
                raw.append(score)
                flags.append(unparsed)
        empty = torch.zeros(0, dtype=torch.float64, device="cpu")
        score = torch.cat(raw) if raw else empty  # [N] float64
        details = {"vlm_judge_score": score.float()}
        if logits:
            details["vlm_judge_token_mass"] = (torch.cat(other) if other else empty).float()
        if logits and self.writes_first:
            details["vlm_judge_no_marker"] = (torch.cat(flags) if flags else empty).float()
        if not logits:
            details["vlm_judge_unparsed"] = (torch.cat(flags) if flags else empty).float()
        missed = int(sum(float(f.sum()) for f in flags))
        if missed:
            self._warn(missed, len(prompts))
        return RewardOutput(scores=((score - lo) / (hi - lo)).float(), details=details)

    def _from_logits(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(expected score, probability of the score digits) [n] float64 on the CPU, from one forward pass."""
        logits = self._model(**batch, logits_to_keep=1).logits[:, -1].double().cpu()  # [n, V] at the answer position
        digits = torch.arange(self.options.scale_min, self.options.scale_max + 1, dtype=torch.float64, device="cpu")
        ids = torch.tensor(self._digit_ids, dtype=torch.long, device="cpu")
        expected = (logits[:, ids].softmax(-1) * digits).sum(-1)  # [n]
        mass = logits.softmax(-1)[:, ids].sum(-1)  # [n]
        return expected, mass

    def _generate(self, batch: Any, stop: str | None) -> list[str]:
        """The judge's greedy answers to a batch, decoded; at most ``max_new_tokens`` tokens, a row ending once it
        has written ``stop`` (when given)."""
        tokenizer = self._processor.tokenizer
        until = {"stop_strings": [stop], "tokenizer": tokenizer} if stop else {}
        out = self._model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=self.options.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **until,
        )
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    def _from_answer(self, answers: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(parsed score or the fallback, 1 where it is the fallback) [n] float64 on the CPU, each answer read after
        ``answer_prefix`` (which may hold the marker)."""
        o = self.options
        fallback = float(o.scale_min if o.fallback_score is None else o.fallback_score)
        parsed = [parse_score(o.answer_prefix + a, o.scale_min, o.scale_max, o.answer_marker) for a in answers]
        scores = [fallback if p is None else p for p in parsed]
        missing = [float(p is None) for p in parsed]
        return (
            torch.tensor(scores, dtype=torch.float64, device="cpu"),
            torch.tensor(missing, dtype=torch.float64, device="cpu"),
        )

    def _warn(self, count: int, total: int) -> None:
        with self._lock:
            self.unparsed += count
            so_far = self.unparsed
        o = self.options
        if o.score_from == "logits":
            what = f"wrote no {o.answer_marker!r} within max_new_tokens = {o.max_new_tokens} (appended, detail "
            what += "vlm_judge_no_marker)"
        else:
            what = f"gave no score on the scale {o.scale_min}-{o.scale_max} (scored the fallback, marked in the "
            what += "reward detail vlm_judge_unparsed)"
        logger.warning("vlm-judge: %d of %d answers %s; %d so far.", count, total, what, so_far)
