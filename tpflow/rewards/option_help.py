"""The descriptions of the option fields several rewards declare, each written once.

A reward's options keep their own defaults and bounds (``tpflow components reward NAME`` lists them) and take the
field's description from here, so ``device`` or ``dtype`` reads the same on every reward; where the rewards differ,
the one text says how (tests/test_option_descriptions.py holds it: no two rewards describe one name two ways, but
for the few names that mean another thing in each reward, listed there). Plain strings, no import.
"""

from __future__ import annotations

DEVICE = (
    "Device of the reward's models: a torch device, 'auto' picking CUDA when available (ocr: a device of its "
    "paddleocr backend, such as 'cpu' or 'gpu:0'; unset: paddleocr's own choice)."
)
DTYPE = (
    "Precision of the model's weights and activations (pickscore's reference scores in float32; hpsv3's package runs "
    "its VLM in bfloat16 and keeps the head in float32)."
)
BATCH_SIZE = "Images per forward pass (a pairwise judge's pair is two)."
MAX_PIXELS = (
    "Most pixels of an image resized for the Qwen-VL vision tower (Qwen2-VL's max_pixels; the HPSv3 package: "
    "200704, the UnifiedReward judge script: 16384·28²)."
)
CLIP_MODEL = (
    "open_clip architecture of the reward's CLIP model: the one whose image embedding the aesthetic head reads, or "
    "GenEval's colour classifier (both ViT-L-14)."
)
CLIP_PRETRAINED = (
    "open_clip weights of that model: a local checkpoint file, or a pretrained tag whose file is already in the "
    "Hugging Face cache (both default to openai: the LAION aesthetic head was trained on OpenAI's ViT-L/14 "
    "embeddings, GenEval classifies with them; for OpenAI weights from a file, use clip_model = "
    "'ViT-L-14-quickgelu')."
)
