"""Learning-rate schedule values at hand-computed points, and state round trip."""

import math

import pytest
import torch

from pretrain.optim import lr_at, make_lr_scheduler

BASE = dict(base_lr=1e-3, warmup_steps=10, decay_steps=110)


def test_warmup():
    assert lr_at(0, **BASE) == pytest.approx(1e-4)  # (0+1)/10: never a step at lr 0
    assert lr_at(4, **BASE) == pytest.approx(5e-4)
    assert lr_at(9, **BASE) == pytest.approx(1e-3)  # warmup reaches base_lr on its last step


def test_linear_decay():
    assert lr_at(10, **BASE, decay="linear") == pytest.approx(1e-3)
    assert lr_at(60, **BASE, decay="linear") == pytest.approx(5e-4)  # halfway through 100 decay steps
    assert lr_at(85, **BASE, decay="linear") == pytest.approx(2.5e-4)
    assert lr_at(110, **BASE, decay="linear") == 0.0
    assert lr_at(500, **BASE, decay="linear") == 0.0
    assert lr_at(60, **BASE, decay="linear", min_lr=1e-4) == pytest.approx(1e-4 + 9e-4 * 0.5)
    assert lr_at(200, **BASE, decay="linear", min_lr=1e-4) == pytest.approx(1e-4)


def test_poly_decay():
    assert lr_at(10, **BASE, decay="poly", power=0.5) == pytest.approx(1e-3)
    assert lr_at(60, **BASE, decay="poly", power=0.5) == pytest.approx(1e-3 * math.sqrt(0.5))
    assert lr_at(85, **BASE, decay="poly", power=0.5) == pytest.approx(5e-4)  # sqrt(0.25)
    assert lr_at(110, **BASE, decay="poly", power=0.5) == 0.0
    assert lr_at(111, **BASE, decay="poly", power=0.5, min_lr=2e-5) == pytest.approx(2e-5)


def test_constant_and_no_warmup():
    assert lr_at(3, **BASE, decay="constant") == pytest.approx(4e-4)
    assert lr_at(10_000, **BASE, decay="constant") == pytest.approx(1e-3)
    assert lr_at(0, base_lr=1e-3, warmup_steps=0, decay_steps=100) == pytest.approx(1e-3)
    assert lr_at(50, base_lr=1e-3, warmup_steps=0, decay_steps=100) == pytest.approx(5e-4)


@pytest.mark.parametrize("bad", [dict(decay="exponential"), dict(decay_steps=10), dict(min_lr=2e-3),
                                 dict(warmup_steps=-1), dict(decay="poly", power=0.0)])
def test_invalid_settings(bad):
    with pytest.raises(ValueError, match="lr schedule"):
        lr_at(0, **{**BASE, **bad})


def test_cosine_decay():
    assert lr_at(10, **BASE, decay="cosine") == pytest.approx(1e-3)
    assert lr_at(60, **BASE, decay="cosine") == pytest.approx(5e-4)  # cos(pi/2) = 0: halfway
    assert lr_at(35, **BASE, decay="cosine") == pytest.approx(1e-3 * 0.5 * (1 + math.sqrt(0.5)))  # cos(pi/4)
    assert lr_at(85, **BASE, decay="cosine", min_lr=1e-4) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 - math.sqrt(0.5)))
    assert lr_at(110, **BASE, decay="cosine", min_lr=1e-4) == pytest.approx(1e-4)
    assert lr_at(109, **BASE, decay="cosine") > 0.0


def test_inverse_square_root_decay():
    # base_lr * sqrt(warmup / step) from the end of warmup: 1e-3 at step 10, halved at step 40
    assert lr_at(10, **BASE, decay="inverse_sqrt") == pytest.approx(1e-3)
    assert lr_at(40, **BASE, decay="inverse_sqrt") == pytest.approx(5e-4)
    assert lr_at(90, **BASE, decay="inverse_sqrt") == pytest.approx(1e-3 / 3)
    assert lr_at(90, **BASE, decay="inverse_sqrt", min_lr=4e-4) == pytest.approx(4e-4)  # the floor
    assert lr_at(110, **BASE, decay="inverse_sqrt", min_lr=1e-5) == pytest.approx(1e-5)  # past the horizon
    # without warmup it starts at base_lr and halves at step 4
    assert lr_at(0, base_lr=1e-3, warmup_steps=0, decay_steps=100, decay="inverse_sqrt") == pytest.approx(1e-3)
    assert lr_at(4, base_lr=1e-3, warmup_steps=0, decay_steps=100, decay="inverse_sqrt") == pytest.approx(5e-4)


def test_decay_horizon_apart_from_the_run_length():
    """scheduler.decay_steps and scheduler.warmup_fraction resolve as Megatron's --lr-decay-iters and
    --lr-warmup-fraction (a share of the horizon), and reach the scheduler the trainer builds."""
    from pretrain.config import load_config

    cfg = load_config(None, ["train.train_steps=100", "scheduler.decay_steps=400", "scheduler.warmup_fraction=0.05"])
    cfg.validate()
    s = cfg.scheduler
    assert (s.warmup(100), s.horizon(100)) == (20, 400)
    assert lr_at(99, base_lr=1.0, warmup_steps=20, decay_steps=400) == pytest.approx(1 - 79 / 380)  # not 0 at the end
    assert load_config(None, ["scheduler.warmup_steps=7"]).scheduler.warmup(1000) == 7
    assert load_config(None, ["scheduler.warmup_fraction=0.1"]).scheduler.warmup(1000) == 100


def _optimizer():
    p = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([dict(params=[p]), dict(params=[torch.nn.Parameter(torch.zeros(1))])], lr=123.0)


def test_scheduler_follows_lr_at_and_round_trips():
    opt = _optimizer()
    sched = make_lr_scheduler(opt, **BASE, decay="poly", power=0.5)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(1e-4)] * 2  # lr for step 0
    for step in range(1, 31):
        opt.step()
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(lr_at(step, **BASE, decay="poly"))] * 2
    state = sched.state_dict()

    fresh_opt = _optimizer()
    fresh = make_lr_scheduler(fresh_opt, **BASE, decay="poly", power=0.5)
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 30
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(lr_at(30, **BASE, decay="poly"))
    assert fresh.get_last_lr() == pytest.approx([lr_at(30, **BASE, decay="poly")] * 2)
    opt.step()
    sched.step()
    fresh_opt.step()
    fresh.step()
    assert fresh_opt.param_groups[1]["lr"] == opt.param_groups[1]["lr"] == pytest.approx(lr_at(31, **BASE, decay="poly"))
