"""A run's learning-rate schedule as its Config resolves it, and what a resume changes of it.

The checkpoint keeps only the step count (schedule.py's WarmupDecayLR): the schedule comes from the
run's config, so a resume may lengthen it (raise train.train_steps, move scheduler.decay_steps).
That is allowed, but never silent: `schedule_change` is the start-up line saying what moved (the
warmup, the stable stage's end, the decay horizon, the rates) and the rate of the next step under
the checkpoint's schedule and under the run's.
"""
from __future__ import annotations

from ..config import Config
from ..config.token_clock import TokenClock
from .schedule import lr_at, steps_clock


def resolved_schedule(cfg: Config) -> dict:
    """lr_at's keyword arguments for `cfg` (lengths in the schedule's unit, steps or tokens)."""
    o, s = cfg.optimizer, cfg.scheduler
    clock = TokenClock.of(cfg)
    lengths = s.lengths(cfg.train.train_steps, clock.tokens_before if s.in_tokens else int)
    return dict(base_lr=o.lr, warmup_steps=lengths["warmup_steps"], decay_steps=lengths["decay_steps"],
                decay=s.decay, power=s.power, min_lr=s.min_lr, decay_start=lengths["decay_start"],
                warmup_from_min=s.warmup_from_min)


def schedule_clock(cfg: Config):
    """(position, size) of step number n+1 given n completed steps, in the schedule's unit."""
    return TokenClock.of(cfg).schedule_clock if cfg.scheduler.in_tokens else steps_clock


def lr_of_step(cfg: Config, completed: int) -> float:
    """The rate the step after `completed` steps uses under `cfg`'s schedule."""
    position, size = schedule_clock(cfg)(completed)
    return lr_at(position, size=size, **resolved_schedule(cfg))


def _unit(cfg: Config) -> str:
    return "tokens" if cfg.scheduler.in_tokens else "steps"


def _lengths(cfg: Config) -> dict[str, str]:
    """The schedule's parts in words, to compare a checkpoint's with a run's."""
    r, unit = resolved_schedule(cfg), _unit(cfg)
    decay_start = r["warmup_steps"] if r["decay_start"] is None else r["decay_start"]
    return {
        "warmup": f"{r['warmup_steps']:,} {unit}" + (" from min_lr" if r["warmup_from_min"] else ""),
        "stable stage until": f"{decay_start:,} {unit}",
        "decay horizon": f"{r['decay_steps']:,} {unit}",
        "decay": r["decay"] + (f" (power {r['power']})" if r["decay"] == "poly" else ""),
        "peak lr": f"{r['base_lr']:.3g}",
        "min_lr": f"{r['min_lr']:.3g}",
    }


def schedule_change(saved: Config, ours: Config, step: int) -> str | None:
    """The line a resume at `step` logs when the run's schedule differs from the checkpoint's
    (`saved`: the config in its meta.json); None when they agree."""
    theirs, mine = _lengths(saved), _lengths(ours)
    before, after = lr_of_step(saved, step), lr_of_step(ours, step)
    changed = [f"{name} {theirs[name]} -> {mine[name]}" for name in mine if theirs[name] != mine[name]]
    if not changed and before == after:
        return None
    if "decay horizon" not in " ".join(changed):
        changed.append(f"decay horizon {mine['decay horizon']} (unchanged)")
    return (f"the LR schedule differs from the checkpoint's: {'; '.join(changed)}. The rate of step {step + 1} is "
            f"{before:.4g} in the checkpoint's schedule and {after:.4g} in this run's, which it follows from here")
