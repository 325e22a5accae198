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


# ----------------------------------------------------------------------------- warmup-stable-decay
def transformers_wsd_rates(steps, base_lr, warmup, stable, decay, decay_type, min_lr_ratio):
    """transformers' get_wsd_schedule on a real optimizer: the rate of each of `steps` steps."""
    from transformers.optimization import get_wsd_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = get_wsd_schedule(opt, num_warmup_steps=warmup, num_stable_steps=stable, num_decay_steps=decay,
                             decay_type=decay_type, min_lr_ratio=min_lr_ratio)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("decay", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("min_lr", [0.0, 1e-6])
def test_wsd_is_transformers_get_wsd_schedule_at_every_step(decay, min_lr):
    base, warmup, stable, length = 1e-3, 7, 20, 13
    ref = transformers_wsd_rates(50, base, warmup, stable, length, decay, min_lr / base)
    sched = make_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base), base, warmup,
                              warmup + stable + length, decay, min_lr=min_lr, decay_start=warmup + stable,
                              warmup_from_min=True)
    ours = []
    for _ in range(50):
        ours.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert ours[warmup + stable - 1] == base and ours[warmup + stable + 1] < base  # a stable stage, then the decay
    # the default warmup is the same ramp one step earlier (it never steps at lr 0), the rest identical
    plain = [lr_at(k, base, warmup, warmup + stable + length, decay, min_lr=min_lr, decay_start=warmup + stable)
             for k in range(50)]
    assert plain[warmup:] == pytest.approx(ref[warmup:])
    if min_lr == 0:
        assert plain[:warmup] == pytest.approx(ref[1:warmup + 1])


def test_one_minus_sqrt_decay_formula():
    # ModernBERT's OneMinusSqrtScheduler: alpha_f + (1 - alpha_f)(1 - sqrt((n - (N_T - N_C)) / N_C))
    base, alpha_f = 1e-3, 0.001
    for n in range(100, 200, 7):
        expected = base * (alpha_f + (1 - alpha_f) * (1 - math.sqrt((n - 100) / 100)))
        assert lr_at(n, base, 0, 200, "1-sqrt", min_lr=base * alpha_f, decay_start=100) == pytest.approx(expected)


@pytest.mark.parametrize("decay", ["linear", "cosine", "1-sqrt", "poly", "constant"])
def test_token_counted_lengths_equal_their_step_equivalents_with_a_fixed_batch(decay):
    from pretrain.config.token_clock import TokenClock

    clock = TokenClock(global_batch_size=24, seq_length=128)
    per_step = 24 * 128
    steps = dict(warmup_steps=5, decay_steps=60, decay_start=30)
    tokens = {key: value * per_step for key, value in steps.items()}
    for k in range(70):
        position, size = clock.schedule_clock(k)
        assert (position, size) == (k * per_step, per_step)
        assert lr_at(position, 1e-3, decay=decay, size=size, **tokens) == lr_at(k, 1e-3, decay=decay, **steps)


def test_a_scheduler_on_a_token_clock_resumes_from_its_step_count():
    from pretrain.config.token_clock import TokenClock

    clock = TokenClock(global_batch_size=8, seq_length=16, ramp_tokens=2000, ramp_min=2)
    kwargs = dict(decay="1-sqrt", decay_start=3000, clock=clock.schedule_clock)
    run = make_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1.0, 500, 6000, **kwargs)
    for _ in range(40):
        run.optimizer.step()
        run.step()
    resumed = make_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1.0, 500, 6000, **kwargs)
    resumed.load_state_dict(run.state_dict())
    assert resumed.get_last_lr() == run.get_last_lr() and resumed.optimizer.param_groups[0]["lr"] == run.get_last_lr()[0]


def test_the_token_clock_ramps_in_multiples_of_its_minimum():
    from pretrain.config.token_clock import TokenClock

    clock = TokenClock(global_batch_size=64, seq_length=32, ramp_tokens=20_000, ramp_min=8)
    sizes = [clock.batch(k) for k in range(clock.ramp_steps + 3)]
    assert sizes[0] == 8 and sizes[-1] == 64 and clock.batch(clock.ramp_steps) == 64
    assert all(b % 8 == 0 for b in sizes) and sizes == sorted(sizes) and len(set(sizes)) > 4
    # step k's size is the linear ramp at the tokens before it, rounded down to whole units
    for k in range(clock.ramp_steps):
        seen = clock.tokens_before(k)
        assert clock.batch(k) == max(8, int((8 + 56 * seen / 20_000) // 8) * 8)
        assert clock.tokens_before(k + 1) == seen + clock.batch(k) * 32
    assert clock.tokens_before(clock.ramp_steps) >= 20_000 > clock.tokens_before(clock.ramp_steps - 1)
    later = clock.ramp_steps + 5
    assert clock.tokens_before(later) == clock.tokens_before(clock.ramp_steps) + 5 * 64 * 32
    assert clock.step_at_samples(clock.samples_before(later)) == later
    assert clock.step_at_samples(clock.samples_before(3) + 1) is None
    assert TokenClock(64, 32).ramp_steps == 0 and TokenClock(64, 32).batch(0) == 64


def test_a_resume_that_moves_the_schedule_names_what_moved_and_the_next_rate_under_both():
    """run_schedule.schedule_change: None for the same schedule; for a longer run the horizon (old and
    new) and the next step's rate under each, in the schedule's unit (steps or tokens)."""
    from pretrain.config import load_config
    from pretrain.optim.run_schedule import lr_of_step, schedule_change

    def cfg(*overrides):
        return load_config(None, ["optimizer.lr=0.01", "scheduler.warmup_steps=10", *overrides])

    short = cfg("train.train_steps=100")
    assert schedule_change(short, cfg("train.train_steps=100"), 50) is None
    line = schedule_change(short, cfg("train.train_steps=200"), 100)
    assert "decay horizon 100 steps -> 200 steps" in line, line
    assert "warmup" not in line and "peak lr" not in line, line  # only what moved
    assert "The rate of step 101 is 0 in the checkpoint's schedule and 0.005263 in this run's" in line, line
    assert lr_of_step(cfg("train.train_steps=200"), 100) == pytest.approx(0.01 * (1 - 90 / 190))
    # an explicit horizon: a longer run leaves the schedule alone
    assert schedule_change(cfg("train.train_steps=100", "scheduler.decay_steps=300"),
                           cfg("train.train_steps=200", "scheduler.decay_steps=300"), 100) is None
    # the same horizon with another peak: the horizon is named as unchanged, the rates differ
    line = schedule_change(short, cfg("train.train_steps=100", "optimizer.lr=0.02"), 50)
    assert "peak lr 0.01 -> 0.02" in line and "decay horizon 100 steps (unchanged)" in line, line
    # WSD counted in tokens (batch 64 x seq 128 = 8,192 tokens a step): the decay's start moved
    wsd = ["train.train_steps=100", "scheduler.warmup_steps=0", "scheduler.warmup_tokens=81920",
           "scheduler.decay=1-sqrt", "train.global_batch_size=64", "data.seq_length=128"]
    line = schedule_change(cfg(*wsd, "scheduler.decay_start_tokens=409600"),
                           cfg(*wsd, "scheduler.decay_start_tokens=614400"), 60)
    assert "stable stage until 409,600 tokens -> 614,400 tokens" in line, line
    assert "decay horizon 819,200 tokens (unchanged)" in line, line
