"""The run's checkpoints: when one is due, saving it (crash-safe, with retention: checkpoint.keep_last),
and where a run starts: its own latest checkpoint, or `checkpoint.init_from`, or from scratch."""
from __future__ import annotations

import logging

from ..checkpoint import exact as checkpoint_saving, load as checkpoint_loading
from ..checkpoint.data_sequence import data_sequence_problems, resumed_data_changes
from ..checkpoint.format import CheckpointError
from ..checkpoint.starting_point import untrained_head_notes
from ..config import Config
from ..distributed import internals
from ..distributed.parallel import Parallel
from ..model.rng import RngTracker
from ..resilience.watchdog import Watchdog

logger = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, cfg: Config, parallel: Parallel, engine, model, tracker: RngTracker, watchdog: Watchdog):
        self.cfg, self.parallel, self.engine, self.model = cfg, parallel, engine, model
        self.tracker, self.watchdog = tracker, watchdog

    def due(self, step: int) -> bool:
        interval = self.cfg.checkpoint.save_interval
        return bool(interval) and step % interval == 0

    def save(self, step: int, consumed_samples: int) -> None:
        t = self.cfg.checkpoint
        if not t.save_dir:
            return
        self.watchdog.doing(f"saving the checkpoint of step {step}", step)
        tag = checkpoint_saving.save_checkpoint(self.engine, t.save_dir, step, consumed_samples, self.cfg,
                                                self.parallel, self.tracker, t.keep_last)
        logger.info(f"saved checkpoint {t.save_dir}/{tag}")
        self.watchdog.progress(f"the save of step {step}", step)

    def resume(self) -> tuple[int, int]:
        """(step, consumed samples) to go on from: a checkpoint's in checkpoint.load_dir, else (0, 0)
        after initialising from checkpoint.init_from if given."""
        t = self.cfg.checkpoint
        found, changes = None, resumed_data_changes(self.cfg)
        if changes and not t.accept_new_data:  # python -m pretrain refuses it before the ranks start
            raise CheckpointError("\n".join(data_sequence_problems(self.cfg)))
        if t.load_dir:
            found = checkpoint_loading.resume(self.engine, self.model, t.load_dir, self.cfg, self.parallel,
                                              self.tracker)
            if found is None and t.load_dir != t.save_dir and not t.init_from:
                raise CheckpointError(f"no checkpoint in {t.load_dir} (no 'latest' file)")
        if found is None:
            if t.init_from:
                loaded = checkpoint_loading.init_from(self.engine, self.model, t.init_from, self.cfg, self.parallel,
                                                      t.init_optimizer_states)
                what = "weights and optimizer states" if t.init_optimizer_states else "weights"
                logger.info(f"initialised {what} from {loaded}; starting at step 0")
                for note in untrained_head_notes(self.cfg):
                    logger.info(f"note: {note}")
            elif t.load_dir:
                logger.info(f"no checkpoint in {t.load_dir} yet: starting from scratch")
            return 0, 0
        step, consumed_samples = found
        if changes:
            logger.info(f"data settings changed ({'; '.join(changes)}); checkpoint.accept_new_data: the new sample "
                        f"sequence starts over from its first sample ({consumed_samples} samples of the old one seen)")
            consumed_samples = 0
        if self.cfg.train.precision == "fp16":  # DeepSpeed's checkpoint carries the loss scaler object itself
            internals.let_loss_scaler_reach_minimum(self.engine)
        logger.info(f"resumed from {t.load_dir} at step {step} ({consumed_samples} samples)")
        return step, consumed_samples
