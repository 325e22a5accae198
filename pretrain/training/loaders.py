"""The loaders of one run: the training stream and one loader per evaluation set, kept across
evaluations, their worker processes named for the hang watchdog and closed together."""
from __future__ import annotations

import logging
import time

from ..config import Config
from ..config.token_clock import TokenClock
from ..data.samples.batch_ramp import MicroBatchesPerStep
from ..data.samples.batches import FixedMicroBatches, MicroBatchIterator
from ..data.samples.skipped import Ranges
from ..distributed.parallel import Parallel
from ..resilience.watchdog import process_state

logger = logging.getLogger(__name__)


class TrainingBatches(MicroBatchIterator):
    """The training stream, whose loader start-up (its processes starting and building their first
    batches: seconds, at the first draw and after a restart) is logged on its own line and left out
    of `wait_seconds`, which would otherwise make the first log window read as a data bottleneck."""

    def __init__(self, *args, num_workers: int = 0, **kwargs):
        super().__init__(*args, num_workers=num_workers, **kwargs)
        self.num_workers = num_workers
        self.start_seconds = 0.0  # every start-up of its loader processes so far

    def __next__(self):
        if not self.num_workers or self.worker_pids():  # no processes to start, or running
            return super().__next__()
        waited, started = self.wait_seconds, time.perf_counter()
        batch = super().__next__()
        seconds = time.perf_counter() - started
        self.wait_seconds, self.start_seconds = waited, self.start_seconds + seconds
        processes = f"{self.num_workers} loader process" + ("es" if self.num_workers > 1 else "")
        logger.info(f"training loader started in {seconds:.1f} s ({processes}; not counted in the data wait)")
        return batch


class Loaders:
    def __init__(self, cfg: Config, parallel: Parallel, grad_accum: int):
        self.cfg, self.parallel, self.grad_accum = cfg, parallel, grad_accum
        self._training: MicroBatchIterator | None = None
        self._evaluation: dict[int, FixedMicroBatches] = {}  # by dataset

    def __enter__(self) -> "Loaders":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def workers(self) -> int:
        p = self.parallel
        # Middle pipeline stages never draw: no loader processes for them.
        return self.cfg.data.num_workers if (p.is_first_stage or p.is_last_stage) else 0

    @property
    def pack_group(self) -> int:
        """data.packing packs a rank's share of a step (its micro-batches) together; 0 = unpacked."""
        return self.grad_accum if self.cfg.data.packing else 0

    def training(self, dataset, consumed_samples: int, skipped: Ranges = (), first_step: int = 0) -> TrainingBatches:
        """This rank's micro-batches of `dataset` from sample `consumed_samples` on (where step
        `first_step` + 1 starts), stepping over the `skipped` ranges of the sequence; closed with the rest."""
        p, t = self.parallel, self.cfg.train
        if self._training is not None:
            self._training.close()
        pack_group = self.pack_group
        if pack_group and t.batch_warmup_tokens:  # each step's share of the batch warmup, packed together
            pack_group = MicroBatchesPerStep(TokenClock.of(self.cfg), first_step, t.micro_batch_size * p.dp_size)
        self._training = TrainingBatches(dataset, consumed_samples, t.micro_batch_size, p.dp_rank,
                                         p.dp_size, p.device, num_workers=self.workers, pack_group=pack_group,
                                         skipped=skipped)
        return self._training

    def evaluation(self, dataset) -> FixedMicroBatches:
        """The evaluation's micro-batches of `dataset`, its loader started once for every evaluation."""
        batches = self._evaluation.get(id(dataset))
        if batches is None:
            p = self.parallel
            batches = self._evaluation[id(dataset)] = FixedMicroBatches(
                dataset, self.cfg.eval.steps * self.grad_accum, self.cfg.train.micro_batch_size, p.dp_rank,
                p.dp_size, p.device, num_workers=self.workers, pack_group=self.pack_group)
        return batches

    def report(self) -> list[str]:
        """For the watchdog's dump: this rank's loader processes and what state each is in."""
        loaders = [("training", self._training)] + [("evaluation", b) for b in self._evaluation.values()]
        return [f"{name} loader process {pid}: {process_state(pid)}"
                for name, batches in loaders if batches is not None for pid in batches.worker_pids()]

    def close(self) -> None:
        for batches in [self._training, *self._evaluation.values()]:
            if batches is not None:
                batches.close()
        self._training = None
        self._evaluation.clear()
