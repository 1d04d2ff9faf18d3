"""The dtypes a diffusers backbone holds its parts in (tpflow/backbones/placement.py, diffusers_common.load_pipeline):
each model's float32 islands kept as its library's ``from_pretrained`` keeps them, the VAE decoding with the stored
weights (not their rounding to the pipeline dtype), and a full fine-tune's fp32 masters and KL reference equal to
the stored weights exactly."""

from __future__ import annotations

import pytest
import torch

from tpflow.backbones import tiny
from tpflow.backbones.placement import place
from tpflow.registry import build

WAN = {"resolution": 32, "num_frames": 5, "max_sequence_length": 32}


def dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor.dtype for name, tensor in named if tensor.is_floating_point()}


def loaded(pipe, folder, dtype):
    """``pipe`` saved into ``folder``, and loaded back by diffusers in ``dtype`` (its models' own dtype handling)."""
    from diffusers.pipelines import pipeline_utils

    if not (folder / "model_index.json").is_file():
        pipe.save_pretrained(folder)
    keyword = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"  # as load_pipeline passes it
    return type(pipe).from_pretrained(folder, **{keyword: dtype})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``get(kind)``: the tiny pipeline of that kind ("sd3", "wan", "wan2.2") and its folder, saved once."""
    makers = {"sd3": tiny.tiny_sd3_pipeline, "wan": tiny.tiny_wan_pipeline, "wan2.2": tiny.tiny_wan22_pipeline}
    done = {}

    def get(kind: str):
        if kind not in done:
            pipe, folder = makers[kind](0), tmp_path_factory.mktemp(kind.replace(".", ""))
            pipe.save_pretrained(folder)
            done[kind] = pipe, folder
        return done[kind]

    return get


@pytest.mark.parametrize(
    "kind, dtype, islands",
    [
        # WanTransformer3DModel._keep_in_fp32_modules, in every half dtype; UMT5's "wo" only under fp16
        ("wan", torch.bfloat16, {"transformer": ["time_embedder", "scale_shift_table", "norm2", "rope.freqs_cos"]}),
        ("wan", torch.float16, {"transformer": ["time_embedder", "rope.freqs_sin"], "text_encoder": [".wo."]}),
        ("sd3", torch.float16, {"text_encoder_3": [".wo."]}),  # T5-XXL's "wo" under SD3.5-Medium's fp16
    ],
)
def test_a_twin_is_placed_as_from_pretrained_loads_the_real_model(saved, kind, dtype, islands):
    """Every part of a tiny twin built in fp32 and placed in ``dtype`` by the backbone holds each tensor in the dtype
    diffusers' / transformers' ``from_pretrained(torch_dtype=dtype)`` gives it (the VAE in fp32, LoRA matrices
    aside); the fp32 islands the libraries name are there."""
    pipe, folder = saved(kind)
    name = {"wan": "tiny-wan", "sd3": "tiny-sd3"}[kind]
    dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    backbone = build("backbone", name, seed=0, dtype=dtype_name, **(WAN if kind == "wan" else {}))
    reference = loaded(pipe, folder, dtype)
    for part, model in backbone.pipe.components.items():
        if not isinstance(model, torch.nn.Module):
            continue
        want = dtypes(getattr(reference, part)) if part != "vae" else dict.fromkeys(dtypes(model), torch.float32)
        got = {n.replace(".base_layer.", "."): d for n, d in dtypes(model).items() if "lora_" not in n}
        assert got == want, part
        for island in islands.get(part, []):
            kept = [n for n, d in got.items() if island in n]
            assert kept and all(got[n] == torch.float32 for n in kept), (part, island)
    assert dtypes(backbone.transformer)["proj_out.weight"] == dtype  # the rest is in the pipeline dtype
    z = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = backbone.velocity(z, torch.full((2,), 0.7), backbone.encode(["a red cat", "two dogs"]), 4.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_place_leaves_a_model_loaded_with_its_islands_as_it_is(saved):
    """A model ``from_pretrained`` loaded in bf16 is already placed: no tensor is cast or copied."""
    pipe, folder = saved("wan")
    model = loaded(pipe, folder, torch.bfloat16).transformer
    before = {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    before_dtypes = dtypes(model)
    place(model, torch.device("cpu"), torch.bfloat16)
    assert {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]} == before
    assert dtypes(model) == before_dtypes and torch.float32 in before_dtypes.values()


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in module.parameters()])


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_fp32_parts_of_a_loaded_pipeline_are_the_stored_weights(saved, finetune):
    """Loaded from a folder in bf16 (Wan2.2 here: one expert trained, the other frozen), the VAE holds the stored
    weights exactly and decodes as the stored VAE does; under ``finetune = "full"`` the trained expert's fp32
    masters and its KL reference are the stored weights exactly, and the frozen expert is in bf16 with its islands.
    (Before: both loaded in bf16 and upcast, relative errors of 1e-3.)"""
    pipe, folder = saved("wan2.2")
    backbone = build("backbone", "wan2.2-t2v-a14b", pretrained=str(folder), device="cpu", dtype="bf16",
                     train_expert="low", finetune=finetune, lora_rank=2, flow_shift=12.0, **WAN)  # fmt: skip
    assert torch.equal(flat(backbone.vae), flat(pipe.vae))
    z = torch.randn((1, *backbone.latent_shape()), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = backbone.decode(z)
        backbone.vae = pipe.vae
        stored = backbone.decode(z)
    assert torch.equal(ours, stored)
    frozen = dtypes(backbone.other)
    assert frozen["proj_out.weight"] == torch.bfloat16 and frozen["condition_embedder.time_embedder.linear_1.weight"]
    assert frozen == dtypes(loaded(pipe, folder, torch.bfloat16).transformer)
    if finetune == "full":
        assert backbone.transformer is backbone.pipe.transformer_2  # the low-noise expert trains
        assert torch.equal(flat(backbone.transformer), flat(pipe.transformer_2))
        assert torch.equal(flat(backbone.adapter._reference), flat(pipe.transformer_2))
        assert all(p.dtype == torch.float32 for p in backbone.trainable_parameters())


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-wan"])
def test_a_full_fine_tune_of_a_twin_in_half_precision_starts_from_its_weights(name):
    """``finetune = "full"`` with ``dtype = "bf16"``: the masters are the twin's weights as built (fp32), not their
    bf16 rounding (1.6e-3 relative before); the text encoders are in bf16."""
    options = {"seed": 0, "dtype": "bf16", "finetune": "full", **(WAN if name == "tiny-wan" else {})}
    backbone = build("backbone", name, **options)
    pipe = tiny.tiny_sd3_pipeline(0) if name == "tiny-sd3" else tiny.tiny_wan_pipeline(0)
    assert torch.equal(flat(backbone.transformer), flat(pipe.transformer))
    assert next(backbone.pipe.text_encoder.parameters()).dtype == torch.bfloat16
