"""``[backbone] finetune = "full"``: every transformer weight trains, through the same trainer, optimizers, EMA,
checkpoints and export as a LoRA (tpflow/backbones/full_finetune.py). The diffusers twins' side (from_pretrained of
the saved model, the reference as the pipeline's samples) is in tests/test_backbone_contract.py."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError
from tpflow.recipe import load_recipe
from tpflow.train.trainer import Trainer


def full_recipe(tmp_path, tiny_weights, optimizer: str = "grpo", extra: list[str] = ()):
    """The suite's tiny shapes recipe with the whole DiT trained (learning rate for full weights, not a LoRA's)."""
    from tests.test_nft_train import nft_recipe

    backbone = f'name = "shapes-dit"\nweights = "{tiny_weights}"\nfinetune = "full"'
    make = nft_recipe if optimizer == "nft" else tiny_recipe  # nft: its KL (kl_weight) uses the reference too
    path = make(tmp_path, None, reward="image-stat", backbone=backbone)
    return load_recipe(path, ["optimizer.learning_rate=1e-4", "eval.every=0", *extra])


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in params])


@pytest.mark.parametrize("optimizer", ["grpo", "nft"])
def test_a_full_fine_tune_trains_the_whole_model_and_resumes_exactly(tmp_path, tiny_weights, optimizer):
    """Every weight is a trainable parameter; training moves them (GRPO's first step on policy: ratio exactly 1);
    a run stopped after one epoch and resumed ends bitwise where the uninterrupted run does (checkpointed weights,
    optimizer moments and EMA of the whole model)."""
    (tmp_path / "straight").mkdir()
    (tmp_path / "split").mkdir()
    one = ["train.prompts_per_epoch=1"]  # one prompt's group of 4 an epoch: image-stat spreads it, the steps are taken
    straight = Trainer(full_recipe(tmp_path / "straight", tiny_weights, optimizer, one))
    params = straight.backbone.trainable_parameters()
    assert [id(p) for p in params] == [id(p) for p in straight.backbone.model.parameters()]
    start = flat(params)
    metrics = straight.fit()
    moved = flat(params) - start
    assert moved.norm() > 0 and metrics["nonfinite_losses"] == 0
    if optimizer == "grpo":
        assert metrics["first_ratio_max_deviation"] == 0.0
    checkpoint = sorted((straight.run_dir / "checkpoints").glob("0*"))[-1]
    assert (checkpoint / "adapter" / "shapes_dit.safetensors").is_file() and (checkpoint / "ema.safetensors").is_file()
    first = Trainer(full_recipe(tmp_path / "split", tiny_weights, optimizer, [*one, "train.epochs=1"]))
    first.fit()
    second = Trainer(full_recipe(tmp_path / "split", tiny_weights, optimizer, one), resume=True)
    assert second.epoch == 1
    second.fit()
    assert torch.equal(flat(second.backbone.trainable_parameters()), flat(params))


def test_the_kl_reference_of_a_full_fine_tune_is_the_model_it_started_from(tmp_path, tiny_weights):
    """After training, ``reference()`` computes the initial weights' velocity (a fresh model's), and leaves the
    trained model as it was."""
    trainer = Trainer(full_recipe(tmp_path, tiny_weights, extra=["train.epochs=1", "optimizer.beta=0.01"]))
    trainer.fit()
    backbone = trainer.backbone
    fresh = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), finetune="full")
    z = backbone.initial_noise(3, torch.Generator().manual_seed(0))
    cond, sigma = backbone.encode(["a red circle", "two squares", "a blue star"]), torch.full((3,), 0.6)
    with torch.no_grad():
        trained = backbone.velocity(z, sigma, cond, 2.0)
        with backbone.reference():
            reference = backbone.velocity(z, sigma, cond, 2.0)
        after = backbone.velocity(z, sigma, cond, 2.0)
        initial = fresh.velocity(z, sigma, cond, 2.0)
    assert torch.equal(reference, initial) and torch.equal(after, trained)
    assert (trained - initial).abs().max() > 1e-4  # training moved the model: the check has teeth


def test_retain_takes_a_full_fine_tunes_first_step_from_the_rollout(tmp_path, tiny_weights):
    """``recompute = "retain"`` keeps the whole model's graphs: the run ends where the native one does."""
    from tests.test_recompute_retain import train_native_and

    full = ['backbone.finetune="full"', "optimizer.learning_rate=1e-4"]
    metrics = train_native_and("retain", tmp_path, tiny_weights, overrides=full)
    assert metrics["retain"]["optimizer_steps"] == metrics["native"]["optimizer_steps"] > 0


def test_reweight_refuses_a_full_fine_tune(tmp_path, tiny_weights):
    """Reweight's per-row gradients are formed at linear layers only; a full fine-tune trains norms and embeddings
    too: refused in one paragraph before anything loads."""
    with pytest.raises(RecipeError, match='finetune = "full" trains every weight'):
        full_recipe(tmp_path, tiny_weights, extra=['optimizer.recompute="reweight"', "optimizer.beta=0"])


# cosine with fp32's. Of the first step's gradient on one rollout: measured 0.9929 (bf16), 0.99993 (fp16). Of a
# 2-epoch train's weight change: 0.863 (bf16), 0.9958 (fp16), lower than a LoRA's (0.99) since AdamW's first steps
# move every weight by about the learning rate whatever its gradient's size, and a full model has many weights whose
# small gradients low precision perturbs
GRADIENT_COSINE = {"bf16": 0.98, "fp16": 0.9995}
DELTA_COSINE = {"bf16": 0.8, "fp16": 0.99}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_full_fine_tunes_gradient_under_mixed_precision_is_fp32s(tiny_weights, mode):
    """fp32 master weights, the forward under CPU bf16 autocast or fp16 (scaled): the first step's gradient over the
    whole model on one rollout points where fp32's does."""
    from tests.test_recompute_retain import ADVANTAGES, first_step_gradient, sample
    from tpflow.precision import Precision

    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), finetune="full")
    sampler = tpflow.build("sampler", "cps")
    batch = sample(backbone, sampler)
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 0.2}
    exact, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, None, **layout)
    low, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, Precision(mode, "cpu"), **layout)
    assert exact.numel() == sum(p.numel() for p in backbone.model.parameters()) and exact.norm() > 0
    cosine = float(torch.nn.functional.cosine_similarity(low.double(), exact.double(), dim=0))
    assert cosine >= GRADIENT_COSINE[mode], cosine


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_full_fine_tune_trains_under_mixed_precision_as_in_fp32(tmp_path, tiny_weights, mode):
    """Through the trainer (autocast, the fp16 scaler, the master weights kept fp32): the weights move the way the
    fp32 run moves them."""
    deltas = {}
    for run in ("no", mode):
        (tmp_path / run).mkdir()
        trainer = Trainer(full_recipe(tmp_path / run, tiny_weights, extra=[f"train.mixed_precision={run}"]))
        params = trainer.backbone.trainable_parameters()
        start = flat(params)
        metrics = trainer.fit()
        assert metrics["nonfinite_losses"] == 0 and all(p.dtype == torch.float32 for p in params)
        deltas[run] = flat(params) - start
    cosine = float(torch.nn.functional.cosine_similarity(deltas[mode], deltas["no"], dim=0))
    assert deltas["no"].norm() > 0 and cosine >= DELTA_COSINE[mode], cosine


def test_an_exported_full_fine_tune_is_the_trained_model(tmp_path, tiny_weights):
    """``tpflow export`` of a full fine-tune writes the whole model (shapes-dit: the weights file ``shapes pretrain``
    writes): a new backbone built on it computes what the trained model computes."""
    from tpflow.export import export

    trainer = Trainer(full_recipe(tmp_path, tiny_weights, extra=["train.epochs=1", "train.ema=false"]))
    trainer.fit()
    summary = export(trainer.run_dir, tmp_path / "export")
    assert not summary["ema"]
    rebuilt = tpflow.build("backbone", "shapes-dit", weights=str(tmp_path / "export" / "shapes_dit.safetensors"))
    base = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights))
    z = base.initial_noise(2, torch.Generator().manual_seed(1))
    cond, sigma = base.encode(["a red circle", "two squares"]), torch.full((2,), 0.4)
    with torch.no_grad():
        trained, again = (b.velocity(z, sigma, cond, 2.0) for b in (trainer.backbone, rebuilt))
        before = base.velocity(z, sigma, cond, 2.0)
    torch.testing.assert_close(again, trained, rtol=0, atol=1e-6)
    assert (trained - before).abs().max() > 1e-4


def test_a_run_without_a_kl_keeps_no_initial_copy(tmp_path, tiny_weights):
    """beta = 0 (GRPO) or kl_weight = 0 (NFT): the frozen initial weights a full fine-tune would keep for the KL
    reference are released as the trainer starts; with a KL they are kept."""
    for name in "abc":
        (tmp_path / name).mkdir()
    without = Trainer(full_recipe(tmp_path / "a", tiny_weights, extra=["optimizer.beta=0"]))
    assert without.backbone.adapter._reference is None
    with pytest.raises(RuntimeError, match="was dropped"), without.backbone.reference():
        pass
    assert Trainer(full_recipe(tmp_path / "b", tiny_weights)).backbone.adapter._reference is not None
    nft = Trainer(full_recipe(tmp_path / "c", tiny_weights, "nft", extra=["optimizer.kl_weight=0"]))
    assert nft.backbone.adapter._reference is None


def test_a_gathered_checkpoint_of_a_sharded_full_fine_tune_loads_with_diffusers(tmp_path):
    """Under FSDP the transformer's class is torch's ``FSDPSD3Transformer2DModel``; the gathered checkpoint's
    ``config.json`` names ``SD3Transformer2DModel`` all the same, so ``diffusers.AutoModel.from_pretrained`` (and the
    class's own) loads the saved folder into the model that was trained. One process, one gloo group of size 1."""
    import json

    import diffusers
    import torch.distributed as dist

    from tpflow.train.sharding import GatheredBackbone, gathered_state, shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        backbone = tpflow.build("backbone", "tiny-sd3", seed=0, finetune="full")
        shard(backbone, torch.device("cpu"), None)
        assert type(backbone.transformer).__name__ == "FSDPSD3Transformer2DModel"
        state = gathered_state(backbone)
        GatheredBackbone(backbone, state).save_adapter(tmp_path / "transformer")
    finally:
        dist.destroy_process_group()
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel"
    model = diffusers.AutoModel.from_pretrained(str(tmp_path / "transformer"))
    assert type(model) is diffusers.SD3Transformer2DModel
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
