"""Whose checkpoints are these? A run never overwrites or deletes checkpoints it did not write.

Every checkpoint records its series in meta.json: an id drawn when a run starts without a checkpoint
to resume (from scratch, or from checkpoint.init_from) and carried by every resume of it. Two
rules follow (torch-free: checked before any rank starts, by `python -m pretrain` and launcher.sh's
--check-config, and again by the checkpointer):

- a run that would start a new series in a checkpoint.save_dir already holding checkpoints, or
  resume one series into a save_dir holding another's, is refused, naming the latest checkpoint
  there and the ways out (unless checkpoint.overwrite: then its saves replace the ones of the same
  step, and the others stay);
- retention (checkpoint.keep_last) only removes checkpoints of the run's own series, never the one
  `latest` names.

Checkpoints written before series were recorded carry none (None); a resume of one carries None on.
"""
from __future__ import annotations

import json
import os
import uuid

from ..config import Config
from .filenames import LATEST, META, TAG_PATTERN

SERIES_KEY = "series"


def new_series() -> str:
    return uuid.uuid4().hex


def complete_tags(save_dir: str) -> list[str]:
    """The iter_* directories holding a meta.json, by step ([] when save_dir does not exist)."""
    try:
        names = os.listdir(save_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [name for name in names if TAG_PATTERN.fullmatch(name) and os.path.exists(os.path.join(save_dir, name, META))]
    return sorted(found, key=lambda name: int(name[len("iter_"):]))


def series_of(tag_dir: str) -> str | None:
    """The series a checkpoint belongs to; None when it records none (written before series were
    recorded, or by a conversion) or its meta.json cannot be read."""
    try:
        with open(os.path.join(tag_dir, META), encoding="utf-8") as f:
            value = json.load(f).get(SERIES_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def named_by_latest(save_dir: str) -> str | None:
    """The tag `latest` names, unchecked (None without a readable `latest`)."""
    try:
        with open(os.path.join(save_dir, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _same_directory(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resumed_tag_dir(cfg: Config) -> str | None:
    """The checkpoint this run resumes: the one checkpoint.load_dir's `latest` names; None when it
    starts a new series (no load_dir, or no `latest` there yet)."""
    load_dir = cfg.checkpoint.load_dir
    tag = named_by_latest(load_dir) if load_dir else None
    return os.path.join(load_dir, tag) if tag else None


def save_dir_problems(cfg: Config, honour_overwrite: bool = True) -> list[str]:
    """One line when this run would write checkpoints into a save_dir holding another series':
    starting a new series there, or resuming from another directory into it (unless
    checkpoint.overwrite and `honour_overwrite`)."""
    t = cfg.checkpoint
    if not t.save_dir or (t.overwrite and honour_overwrite):
        return []
    tags = complete_tags(t.save_dir)
    if not tags:
        return []
    latest = named_by_latest(t.save_dir)
    newest = latest if latest in tags else tags[-1]
    there = (f"checkpoint.save_dir {t.save_dir} already holds {len(tags)} checkpoint{'s' if len(tags) > 1 else ''} "
             f"(latest: {os.path.join(t.save_dir, newest)})")
    resumed = resumed_tag_dir(cfg)
    if resumed is None:
        how = "starts a new run (from checkpoint.init_from)" if t.init_from else "starts from scratch"
        if t.load_dir and _same_directory(t.load_dir, t.save_dir):
            how += f" (no '{LATEST}' file in checkpoint.load_dir)"
        return [f"{there}, and this run {how}: its saves would overwrite them. Resume from them with "
                f"checkpoint.load_dir={t.save_dir}, save into another checkpoint.save_dir, or set "
                f"checkpoint.overwrite=true to start a new series there (its saves replace the checkpoints of the "
                f"same steps; retention removes only its own)"]
    if _same_directory(t.load_dir, t.save_dir):
        return []
    ours = series_of(resumed)
    theirs = {series_of(os.path.join(t.save_dir, tag)) for tag in tags}
    if ours is not None and theirs == {ours}:
        return []  # the same series, copied or moved: its resume goes on writing it
    return [f"{there} of another run than the one this run resumes ({resumed}): its saves would overwrite them. "
            f"Save into checkpoint.load_dir ({t.load_dir}) or another checkpoint.save_dir, or set "
            f"checkpoint.overwrite=true to write there anyway (retention removes only this run's own checkpoints)"]


def own_tags(save_dir: str, series: str | None) -> list[str]:
    """The complete checkpoints of `series` in save_dir, by step: the only ones retention may remove."""
    return [tag for tag in complete_tags(save_dir) if series_of(os.path.join(save_dir, tag)) == series]
