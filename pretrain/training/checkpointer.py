"""The run's checkpoints: when one is due, saving it (crash-safe, with retention: checkpoint.keep_last,
of the run's own series only), and where a run starts: its own latest checkpoint, or
`checkpoint.init_from`, or from scratch; never into a save_dir holding another run's checkpoints
(series.py). With checkpoint.async_save a save is a snapshot written in the background
(checkpoint/async_save.py): one at a time, its failure raised at a step boundary, and `wait()` at a
stop and at the end of training until it is published."""
from __future__ import annotations

import logging
import os
from typing import Callable

from ..checkpoint import exact as checkpoint_saving, load as checkpoint_loading, phases
from ..checkpoint.data_sequence import data_sequence_problems, resumed_data_changes
from ..checkpoint.async_save import BackgroundSave, SaveStore, SnapshotEngine
from ..checkpoint.format import CheckpointError, latest_tag, read_meta, tag_for
from ..checkpoint.series import new_series, resumed_tag_dir, save_dir_problems, series_of
from ..checkpoint.starting_point import untrained_head_notes
from ..checkpoint.tiling import init_tiled
from ..checkpoint.trained_length import KEY as TRAINED_LENGTH, from_hf_dir, from_native_meta, longest
from ..config import Config, ConfigError
from ..distributed import internals
from ..distributed.device import all_gather_object, reduce_floats
from ..distributed.parallel import Parallel
from ..model.rng import RngTracker
from ..optim.run_schedule import schedule_change
from ..resilience.watchdog import Watchdog

logger = logging.getLogger(__name__)


# how often wait() asks every rank whether its save thread is done: quickly at first (a save that is
# nearly written), then every second at most (a tiny all-reduce each)
POLL_FIRST_SECONDS, POLL_MAX_SECONDS = 0.01, 1.0


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class Checkpointer:
    def __init__(self, cfg: Config, parallel: Parallel, engine, model, tracker: RngTracker, watchdog: Watchdog):
        self.cfg, self.parallel, self.engine, self.model = cfg, parallel, engine, model
        self.tracker, self.watchdog = tracker, watchdog
        self.series: str | None = None  # the run's checkpoint series (series.py), known once resume() ran
        # what the trainer's parts keep in every checkpoint (meta.json "trainer_state"), and what the
        # checkpoint last loaded (a resume's, a rollback's) kept
        self.trainer_state: Callable[[], dict] = dict
        self.loaded_state: dict = {}
        self.on_saved: Callable[[str, int], None] | None = None  # (path, step) of each complete save
        # tokens trained on in the phases before this run's (checkpoint.new_phase), kept in its checkpoints
        self.tokens_before_phase = 0
        # the longest sequence length the starting weights were trained at (a resumed or init_from
        # checkpoint's; trained_length.py): with this run's, what its checkpoints and exports state
        self.trained_length_before: int | None = None
        # checkpoint.async_save: the save being written in the background (one at most), the step the
        # loop is at, and every rank's snapshot size (bytes, measured at the first save)
        self._in_flight: BackgroundSave | None = None
        self._step = 0
        self._save_store: SaveStore | None = None
        self.snapshot_bytes: list[int] | None = None
        if cfg.checkpoint.async_save and cfg.checkpoint.save_dir:
            with internals.checkpoint_engine_replaced(engine, SnapshotEngine):
                pass  # refuses a DeepSpeed checkpoint writer it cannot defer now, not at the first save

    def due(self, step: int) -> bool:
        """Whether a save is due after `step`, called at every step boundary: there a background
        save's failure (checkpoint.async_save) is raised, at the step its ranks agreed on."""
        self._step = step
        self._check_in_flight(step)
        interval = self.cfg.checkpoint.save_interval
        return bool(interval) and step % interval == 0

    def save(self, step: int, consumed_samples: int) -> None:
        """Save the checkpoint of `step`: at once, or with checkpoint.async_save a snapshot taken now
        and written in the background (the save before it is published first: one in flight)."""
        t = self.cfg.checkpoint
        if not t.save_dir:
            return
        self.wait()
        with self.watchdog.limited("save"):  # resilience.save_timeout_minutes
            self.watchdog.doing(f"saving the checkpoint of step {step}", step)
            if t.async_save:
                self._step = step
                self._in_flight = checkpoint_saving.save_checkpoint_async(
                    self.engine, t.save_dir, step, consumed_samples, self.cfg, self.parallel, self.tracker,
                    t.keep_last, self.series, self._trainer_state(), self._store(),
                    self.cfg.resilience.save_timeout_minutes * 60, lambda: self._step)
                self.watchdog.progress(f"the snapshot of step {step}", step)
                if self.snapshot_bytes is None:  # a collective, at a step every rank saves
                    self.snapshot_bytes = all_gather_object(self._in_flight.snapshot_bytes)
                    logger.info(f"checkpoint.async_save: the snapshot of a save holds {_mib(max(self.snapshot_bytes))} "
                                f"of host memory on the fullest rank (per rank: "
                                f"{', '.join(_mib(n) for n in self.snapshot_bytes)}) while its files are written")
                return
            tag = checkpoint_saving.save_checkpoint(self.engine, t.save_dir, step, consumed_samples, self.cfg,
                                                    self.parallel, self.tracker, t.keep_last, self.series,
                                                    self._trainer_state())
            self.watchdog.progress(f"the save of step {step}", step)
        logger.info(f"saved checkpoint {t.save_dir}/{tag}")
        if self.on_saved is not None:
            self.on_saved(f"{t.save_dir}/{tag}", step)

    def _trainer_state(self) -> dict:
        """meta.json's "trainer_state": the trainer's parts', and the longest length trained at."""
        trained = longest(self.trained_length_before, self.cfg.data.seq_length)
        return dict(self.trainer_state(), **{TRAINED_LENGTH: trained})

    def wait(self) -> None:
        """Until the save in flight (checkpoint.async_save) is published on every rank, or raise its
        failure. Every rank calls it at the same step (the next save, a stop, the end of training)
        and polls its thread between small collectives (_join_on_every_rank): a rank that dies
        meanwhile fails the next one (rather than rank 0 waiting out its save timeout for a key
        that never comes), and the last one keeps rank 0, whose process serves the job's store,
        alive until every rank has read the outcome there."""
        job = self._in_flight
        if job is None:
            return
        with self.watchdog.limited("save"):  # resilience.save_timeout_minutes
            self.watchdog.doing(f"waiting for the background save of step {job.step} to be published", job.step)
            self._join_on_every_rank(job)
            self._in_flight = None
            if job.error is not None:
                raise job.error
            self.watchdog.progress(f"the save of step {job.step}", job.step)
        self._saved(job)

    def _join_on_every_rank(self, job: BackgroundSave) -> None:
        """Until every rank's save thread has its outcome. Each poll is one all-reduce of "finished"
        (min) on every rank, so all leave at the same poll; a rank gone fails it at once on gloo, or
        after resilience.dist_timeout_minutes on NCCL, instead of a silent wait."""
        poll = POLL_FIRST_SECONDS
        while True:
            job.join(timeout=poll)
            if reduce_floats([job.finished], self.parallel.device, op="min")[0] == 1.0:
                return
            poll = min(poll * 2, POLL_MAX_SECONDS)

    def _check_in_flight(self, step: int) -> None:
        job = self._in_flight
        if job is None or not job.finished:
            return
        error = job.failure_due(step)
        if error is not None:
            self._in_flight = None
            raise error
        if job.error is None:
            self._saved(job)

    def _saved(self, job) -> None:
        if not job.reported:
            job.reported = True
            logger.info(f"saved checkpoint {self.cfg.checkpoint.save_dir}/{tag_for(job.step)} (written in the "
                        f"background in {job.seconds:.1f} s)")
            if self.on_saved is not None:
                self.on_saved(f"{self.cfg.checkpoint.save_dir}/{tag_for(job.step)}", job.step)

    def _store(self) -> SaveStore | None:
        """The job's store, through which the ranks agree on a background save (None: one rank)."""
        if self.parallel.world_size == 1:
            return None
        if self._save_store is None and self.parallel.store_address:
            self._save_store = SaveStore(self.parallel.store_address)
        return self._save_store

    def resume(self) -> tuple[int, int]:
        """(step, consumed samples) to go on from: a checkpoint's in checkpoint.load_dir, else (0, 0)
        after initialising from checkpoint.init_from if given."""
        t = self.cfg.checkpoint
        found, changes = None, resumed_data_changes(self.cfg)
        if changes and not t.accept_new_data:  # python -m pretrain refuses it before the ranks start
            raise CheckpointError("\n".join(data_sequence_problems(self.cfg)))
        overwrites = save_dir_problems(self.cfg, honour_overwrite=False)  # every rank reads the same files
        if overwrites and not t.overwrite:  # python -m pretrain refuses it before the ranks start
            raise CheckpointError("\n".join(overwrites))
        if overwrites:
            logger.warning(f"checkpoint.overwrite: {t.save_dir} holds another run's checkpoints; this run's saves "
                           f"replace those of the same steps, the others stay")
        resumed = resumed_tag_dir(self.cfg)
        # rank 0's draw for every rank: the one meta.json records it, the others keep it in step
        self.series = series_of(resumed) if resumed else all_gather_object(new_series())[0]
        if resumed:  # a large checkpoint's checks and load take a while: said before
            logger.info(f"resuming from {resumed}: checking its files against meta.json, then loading them")
        if t.load_dir:
            found = checkpoint_loading.resume(self.engine, self.model, t.load_dir, self.cfg, self.parallel,
                                              self.tracker)
            if found is None and t.load_dir != t.save_dir and not t.init_from:
                raise CheckpointError(f"no checkpoint in {t.load_dir} (no 'latest' file)")
        if found is None:
            if t.init_from:
                if t.new_phase:
                    self._start_phase()
                logger.info(f"loading checkpoint.init_from {t.init_from}")
                configured = _group_settings(self.engine)
                if t.init_tiled:  # a smaller ModernBERT grown into this run's model (checkpoint/tiling.py)
                    loaded = init_tiled(self.engine, self.model, t.init_from, self.cfg, self.parallel)
                else:
                    loaded = checkpoint_loading.init_from(self.engine, self.model, t.init_from, self.cfg,
                                                          self.parallel, t.loads_optimizer_states)
                # DeepSpeed's load of optimizer states brings the checkpoint's group settings (weight
                # decay, betas, eps, the rate...) with the moments: a new run trains with its own
                _restore_group_settings(self.engine, configured)
                self.engine.lr_scheduler.apply()
                self.trained_length_before = _trained_length_of(t.init_from)
                what = "weights and optimizer states" if t.loads_optimizer_states else "weights"
                logger.info(f"initialised {what} from {loaded}; starting at step 0")
                for note in untrained_head_notes(self.cfg):
                    logger.info(f"note: {note}")
            elif t.load_dir:
                logger.info(f"no checkpoint in {t.load_dir} yet: starting from scratch")
            return 0, 0
        step, consumed_samples = found
        self.engine.lr_scheduler.apply()  # the run's schedule, not the rate the optimizer state was saved with
        meta = read_meta(resumed)  # the tag the load just checked
        self.loaded_state = meta.get("trainer_state", {})
        self.trained_length_before = from_native_meta(meta)
        change = _schedule_change(meta, resumed, self.cfg, step)
        if change:
            logger.info(change)  # the logging rank's: every rank would say the same
        self.tokens_before_phase = int(self.loaded_state.get("tokens_before_phase", 0))
        if changes:
            logger.info(f"data settings changed ({'; '.join(changes)}); checkpoint.accept_new_data: the new sample "
                        f"sequence starts over from its first sample ({consumed_samples} samples of the old one seen)")
            consumed_samples = 0
        if self.cfg.train.precision == "fp16":  # DeepSpeed's checkpoint carries the loss scaler object itself
            internals.let_loss_scaler_reach_minimum(self.engine)
        logger.info(f"resumed from {t.load_dir} at step {step} ({consumed_samples} samples)")
        if step >= self.cfg.train.train_steps:
            where = "at" if step == self.cfg.train.train_steps else "past"
            logger.info(f"nothing to train: the checkpoint resumed from {t.load_dir} is at step {step}, {where} "
                        f"train.train_steps {self.cfg.train.train_steps}; the run is finished. Raise "
                        "train.train_steps to train on (the LR schedule's horizon follows it unless "
                        "scheduler.decay_steps or decay_tokens is set)")
        return step, consumed_samples

    def _start_phase(self) -> None:
        """checkpoint.new_phase: say what the phase changes; count the tokens on from the last phase's."""
        tag_dir, previous, meta = phases.previous_phase(self.cfg)
        self.tokens_before_phase = phases.tokens_seen(meta, previous)
        changed = phases.overrides(previous, self.cfg)
        logger.info(f"checkpoint.new_phase: a new phase from {tag_dir} (its step {meta.get('step')}, "
                    f"{self.tokens_before_phase:,} tokens seen): step 0, its own LR schedule and sample sequence; "
                    + (f"overriding {'; '.join(changed)}" if changed else "no setting changed"))

    def roll_back(self) -> tuple[str, int, int] | None:
        """Reload the run's own latest checkpoint in checkpoint.save_dir (weights, optimizer, LR
        schedule, RNG: exactly as a resume); (its directory, step, consumed samples), or None when
        the run has saved none yet (`latest` there names another series' or nothing)."""
        save_dir = self.cfg.checkpoint.save_dir
        self.wait()  # a background save (checkpoint.async_save) published first: it may be the latest
        tag = latest_tag(save_dir) if save_dir and os.path.isdir(save_dir) else None
        if tag is None or series_of(os.path.join(save_dir, tag)) != self.series:
            return None
        with self.watchdog.limited("save"):  # a reload reads what a save wrote: the same limit
            self.watchdog.doing(f"rolling back to {os.path.join(save_dir, tag)}")
            step, consumed_samples = checkpoint_loading.resume(self.engine, self.model, save_dir, self.cfg,
                                                               self.parallel, self.tracker)
            self.watchdog.progress(f"the rollback to step {step}", step)
        self.engine.lr_scheduler.apply()
        self.loaded_state = read_meta(os.path.join(save_dir, tag)).get("trainer_state", {})
        return os.path.join(save_dir, tag), step, consumed_samples


def _trained_length_of(path: str) -> int | None:
    """The longest length the weights of checkpoint.init_from were trained at, as far as it says."""
    found = checkpoint_loading.native_meta(path)
    return from_hf_dir(path) if found is None else from_native_meta(found[1])


def _schedule_change(meta: dict, tag_dir: str, cfg: Config, step: int) -> str | None:
    """What a resume at `step` changes of the checkpoint's LR schedule (run_schedule.py), in words."""
    if not meta.get("consumed_samples"):  # converted from transformers: trained with no schedule of ours
        return None
    try:
        saved = Config.from_stored(meta["config"], f"{tag_dir}/meta.json")
    except (KeyError, ConfigError):  # unreadable: the load itself would have said so
        return None
    return schedule_change(saved, cfg, step)


# per-group optimizer settings that are not hyperparameters of the run: the tensors, the rate the
# schedule sets at every step, and step counters some optimizers keep in the group
_NOT_SETTINGS = ("params", "lr", "initial_lr", "step")


def _group_settings(engine) -> list[dict]:
    return [{k: v for k, v in group.items() if k not in _NOT_SETTINGS}
            for group in internals.client_optimizer(engine).param_groups]


def _restore_group_settings(engine, settings: list[dict]) -> None:
    for group, configured in zip(internals.client_optimizer(engine).param_groups, settings):
        group.update(configured)
