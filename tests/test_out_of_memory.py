"""Out of GPU memory: the run stops with one paragraph naming the phase and the recipe value that sizes its batch,
writes no checkpoint (an update may be half applied) and says how to resume. Simulated on the CPU by raising CUDA's
own error where the phase would allocate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_train import tiny_recipe
from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.train.out_of_memory import KNOBS, phase_of
from tpflow.train.trainer import Trainer

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB"


def test_every_progress_description_maps_to_its_phase():
    assert phase_of("epoch 3: sampling") == "sampling"
    assert phase_of("epoch 3: scoring") == "scoring"
    assert phase_of("epoch 0: updating") == "updating"
    assert phase_of("eval at epoch 8: sampling 780 images") == "eval"
    assert phase_of("starting") is None


@pytest.mark.parametrize("phase", ["updating", "eval"])
def test_out_of_memory_names_the_phase_and_its_setting(phase, tmp_path: Path, tiny_weights: Path, monkeypatch):
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    trainer = Trainer(load_recipe(recipe, ["train.epochs=2", "eval.every=2", "log.trackers=[]"]))

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(OOM)

    if phase == "updating":
        monkeypatch.setattr(trainer.optimizer, "update", out_of_memory)
    else:
        monkeypatch.setattr("tpflow.train.trainer.evaluate", out_of_memory)
    with pytest.raises(UserError) as info:
        trainer.fit()
    message = str(info.value)
    assert message.startswith("Out of GPU memory while ") and "\n" not in message
    options = {"micro": "optimizer.micro_batch_size", "accumulation": "optimizer.gradient_accumulation_steps"}
    knob = KNOBS[phase].format(**options)
    assert "Tried to allocate 2.00 GiB" in message and knob in message
    # no checkpoint yet (epoch 0): the command starts the run again, every --set of it kept
    assert f"--run-dir {trainer.run_dir}` starts the run again" in message and "--resume" not in message
    checkpoints = trainer.run_dir / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())  # nothing written after the failure
