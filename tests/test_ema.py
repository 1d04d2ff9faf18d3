"""EMA: the reference rule by hand, the `every` gating, exact swap and restore, state round trip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpflow.errors import UserError
from tpflow.train.ema import EMA


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))]


def test_decay_warm_up_then_cap():
    ema = EMA(_params())
    assert ema.decay(0) == pytest.approx(0.1)
    assert ema.decay(7) == pytest.approx(8 / 17)
    assert ema.decay(80) == pytest.approx(81 / 90)
    assert ema.decay(81) == 0.9 and ema.decay(10_000) == 0.9


def test_rule_by_hand_and_every_gating():
    p = nn.Parameter(torch.tensor([0.0, 4.0]))
    ema = EMA([p], decay_cap=0.9, every=8)
    with torch.no_grad():
        p.copy_(torch.tensor([10.0, 0.0]))
    assert [ema.step(n) for n in range(7)] == [False] * 7
    assert torch.equal(ema.shadow[0], torch.tensor([0.0, 4.0]))
    assert ema.step(7)  # d_7 = 8/17: shadow += (9/17)(θ − shadow)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([90 / 17, 4 - 36 / 17]))
    assert ema.step(7)  # same n again (called after every micro-batch): applies again
    torch.testing.assert_close(
        ema.shadow[0], torch.tensor([90 / 17 + 9 / 17 * (10 - 90 / 17), (4 - 36 / 17) * 8 / 17])
    )
    before = ema.shadow[0].clone()
    assert not ema.step(8) and torch.equal(ema.shadow[0], before)
    assert ema.step(95)  # d = 0.9 cap
    torch.testing.assert_close(ema.shadow[0], before + 0.1 * (torch.tensor([10.0, 0.0]) - before))
    assert EMA([p], every=1).step(0)


def test_shadow_is_float32_and_swapped_restores_exactly():
    params = _params()
    ema = EMA(params, every=1)
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    with torch.no_grad():
        for p in params:
            p.add_(0.37)
    live = [p.detach().clone() for p in params]
    ema.step(0)
    expected = [s.to(p.dtype) for s, p in zip(ema.shadow, params, strict=True)]
    with ema.swapped():
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))
    assert all(torch.equal(p, v) for p, v in zip(params, live, strict=True))
    with pytest.raises(RuntimeError, match="boom"), ema.swapped():
        raise RuntimeError("boom")
    assert all(torch.equal(p, v) for p, v in zip(params, live, strict=True))
    assert all(p.requires_grad for p in params)


def test_state_round_trip_and_mismatch():
    params = _params()
    ema = EMA(params, every=1)
    with torch.no_grad():
        params[0].mul_(3)
    ema.step(5)
    state = ema.state_dict()
    assert list(state) == ["0", "1"] and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values()
    )
    other = EMA(_params())
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow, strict=True))
    state["0"].zero_()  # state_dict returns copies
    assert not torch.equal(ema.shadow[0], state["0"])
    with pytest.raises(UserError, match=r"'1' has shape \[3\] in the checkpoint but \[2, 2\] here"):
        other.load_state_dict({"0": torch.zeros(2), "1": torch.zeros(3)})
    with pytest.raises(UserError, match="missing keys"):
        other.load_state_dict({"0": torch.zeros(2)})
    named = EMA(_params(), names=["a.lora_A", "a.lora_B"])
    assert list(named.state_dict()) == ["a.lora_A", "a.lora_B"]
    with pytest.raises(UserError, match="unexpected keys"):
        named.load_state_dict(state)


def test_trainer_updates_the_ema_after_each_optimizer_step(tmp_path, tiny_weights, plugin):
    """Two optimizer steps in one epoch with ema_every = 1: the EMA must average the weights after step 0 and after
    step 1, as the reference does (ema.step right after each optimizer step), not the epoch's final weights twice."""
    from tests.test_train import tiny_recipe
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights), ["train.epochs=1", "eval.every=0"])
    trainer = Trainer(recipe)
    params = trainer.backbone.trainable_parameters()
    shadow = [p.detach().float().clone() for p in params]
    after_each_step: list[list[torch.Tensor]] = []
    torch_optimizer = trainer.optimizer.loop.optimizer
    real_step = torch_optimizer.step

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        after_each_step.append([p.detach().float().clone() for p in params])
        return out

    torch_optimizer.step = step
    trainer.fit()
    assert len(after_each_step) == trainer.optimizer.global_step == 2  # 8 trajectories, micro-batches of 4
    assert not all(torch.equal(a, b) for a, b in zip(*after_each_step, strict=True))  # the two states differ
    for n, weights in enumerate(after_each_step):  # θ_ema ← θ_ema + (1 − d_n)(θ_n − θ_ema), d_n by hand
        d = min((1 + n) / (10 + n), 0.9)
        shadow = [s + (1 - d) * (w - s) for s, w in zip(shadow, weights, strict=True)]
    for expected, got in zip(shadow, trainer.ema.shadow, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_a_resume_without_ema_state_averages_from_the_restored_adapter(tmp_path, tiny_weights, plugin):
    """A checkpoint written with train.ema = false holds no EMA state; resuming (here: warm-starting another run
    dir) with the EMA on must start the shadow at the restored adapter, not at the freshly built adapter's
    initialisation (0.02 apart in the review's reproduction)."""
    from tests.test_train import tiny_recipe
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    sets = ["train.epochs=1", "eval.every=0", "train.ema=false"]
    first = Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), sets))
    init = [p.detach().clone() for p in first.backbone.trainable_parameters()]  # what a fresh build starts from
    first.fit()
    trained = [p.detach().clone() for p in first.backbone.trainable_parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(trained, init, strict=True))  # a shadow of the init would fail
    sets = ["train.epochs=2", "eval.every=0", "train.ema=true", f"train.run_dir={tmp_path / 'warm'}"]
    warm = Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), sets), resume=first.run_dir / "checkpoints")
    restored = warm.backbone.trainable_parameters()
    assert all(torch.equal(p, q) for p, q in zip(restored, trained, strict=True))
    for shadow, param in zip(warm.ema.shadow, restored, strict=True):
        assert torch.equal(shadow, param.detach().float())
