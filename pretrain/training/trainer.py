"""The pretraining loop: it wires the parts (engine, loaders, step runner, skip policy, evaluator,
stop requests, checkpointer, reporter, spike policy, phase timers) and calls them in order; each part
owns its state. A new concern gets its own part beside them, not lines here: this file stays within
250 lines and `train` within 80 (tests/test_structure.py).

The rules every change here keeps: one metric collective and one host sync per log window
(metrics.reduce_metrics); every collective through pretrain/distributed/device.py; every private
DeepSpeed or megatron-core access through pretrain/distributed/internals.py.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable


from ..config import Config
from ..config.token_clock import TokenClock
from ..data.samples.provider import pretraining_datasets
from ..data.samples.skipped import advance, skip_ahead
from ..distributed import device, internals
from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss
from ..model.rng import RngTracker, seed_streams
from ..observability.device_memory import FirstStepMemory
from ..observability.profiling import step_profiler
from ..optim.norms import params_norm
from ..optim.skips import SkipPolicy
from ..resilience.stops import StopRequests
from ..resilience.watchdog import Watchdog
from .checkpointer import Checkpointer
from .engine import build_pretraining_engine, prepare_device
from .evaluator import Evaluator
from .loaders import Loaders
from .metrics import TOKEN_COUNTS, ThroughputWindow, reduce_metrics, reduce_window
from .reporter import Reporter
from .spike_policy import SpikePolicy
from .steps import StepResult, StepRunner
from .timing import phase_timers

logger = logging.getLogger(__name__)

class Trainer:
    def __init__(self, cfg: Config, parallel: Parallel):
        started = time.monotonic()  # resilience.exit_duration_minutes counts from here
        self.cfg, self.parallel = cfg, parallel
        self.reporter = Reporter(cfg, parallel)
        self.step = 0
        self.consumed_samples = 0
        self.stopped: str | None = None  # why train() stopped before train.train_steps, and what it saved
        self.pipelined = parallel.pp_size > 1
        self.grad_accum = cfg.grad_accum_steps(parallel.world_size)
        self.clock = TokenClock.of(cfg)  # each step's global batch (train.batch_warmup_tokens) and tokens

        # what the device held before this run (another run's leftovers in a test process): not its memory
        self._allocated_before = device.device_memory_allocated(parallel.device) or 0
        prepare_device(cfg, parallel)
        self.tracker = RngTracker(parallel.device)
        seed_streams(self.tracker, cfg.train.seed, parallel.tp_rank, parallel.pp_rank, parallel.dp_cp_rank)
        self.loss_fn = PretrainingLoss(parallel.tp_group, parallel.tp_rank, cfg.model.compile)
        built = build_pretraining_engine(cfg, parallel, self.tracker, self.loss_fn)
        self.engine, self.model = built.engine, built.model
        self.timers, self.stragglers = phase_timers(cfg.logging, parallel, self.engine)

        # Rank 0 builds missing sample indices while the others wait; all then map the cache.
        self.train_data, self.valid_data, self.test_data = pretraining_datasets(
            cfg, is_builder=parallel.rank == 0, barrier=device.barrier)
        self.loaders = Loaders(cfg, parallel, self.grad_accum)
        self.watchdog = Watchdog.for_job(cfg.resilience.watchdog_limits(), parallel, self.loaders.report)
        self.steps = StepRunner(cfg, parallel, self.engine, self.loss_fn, built.guard, self.timers, self.watchdog)
        self.skips = SkipPolicy(cfg.resilience.max_consecutive_skips, cfg.fp16.min_loss_scale if cfg.train.precision == "fp16" else None,
                                parallel.world_size)
        self.evaluator = Evaluator(self.engine, self.loss_fn, self.loaders, parallel, cfg.eval.steps, self.watchdog)
        r = cfg.resilience
        self.stops = StopRequests(r.stop_check_interval, r.exit_duration_minutes, parallel, started)
        self.checkpointer = Checkpointer(cfg, parallel, self.engine, self.model, self.tracker, self.watchdog)
        self.checkpointer.on_saved = self.reporter.checkpoint_saved
        self.spikes = SpikePolicy(cfg, parallel, built.guard, self.loss_fn)
        self.checkpointer.trainer_state = lambda: dict(self.spikes.state(), **self._token_state())

    # ----------------------------------------------------------------------------- parts' views
    @property
    def history(self) -> list[dict]:
        """Every step's reduced metrics so far (also after train() raised)."""
        return self.reporter.history

    @property
    def steps_skipped(self) -> int:
        return self.skips.skipped

    @property
    def first_step_memory(self) -> list[dict] | None:
        return self.reporter.first_step_memory

    def train_step(self, data_iter) -> dict:
        """One optimizer step outside the loop (benchmarks); its metrics reduced at once."""
        result = self.steps.run(data_iter, self.step + 1)
        return reduce_metrics(self.parallel, [result.sums], [result.grad_norm])[0]

    def evaluate(self, dataset=None) -> dict:
        """Metrics of `dataset` (default: the validation set) with the current weights."""
        return self.evaluator.evaluate(self.valid_data if dataset is None else dataset, self.step)

    def params_norm(self) -> float:
        """L2 norm of the whole logical model, each parameter counted once in any layout (a collective)."""
        return params_norm(self.model, self.parallel)

    def resume(self) -> None:
        self.step, consumed_samples = self.checkpointer.resume()
        self.spikes.load(self.checkpointer.loaded_state)
        self.consumed_samples = skip_ahead(consumed_samples, self.spikes.skipped)

    def close_loaders(self) -> None:
        self.loaders.close()

    # ----------------------------------------------------------------------------- the loop
    def train(self, after_step: Callable[[StepResult], None] | None = None) -> list[dict]:
        """Run to train.train_steps (or a stop); returns every step's metrics. `after_step` is
        called on every rank with each step's unreduced result, before the skip policy judges it."""
        t = self.cfg.train
        profiler = step_profiler(self.cfg.logging, self.parallel.rank, self.parallel.device)
        with self.stops.on_sigterm(), self.watchdog, self.loaders:
            try:
                self.watchdog.doing("resuming" if self.cfg.checkpoint.load_dir else "start-up", self.step)
                self.resume()
                self.watchdog.progress("start-up", self.step)
                if self.step >= t.train_steps:  # a finished run relaunched (the checkpointer said so)
                    return self.history
                last_step = min(t.train_steps, self.step + (self.cfg.resilience.exit_after_steps or t.train_steps))
                data_iter = self.loaders.training(self.train_data, self.consumed_samples, self.spikes.skipped, self.step)
                window, pending = ThroughputWindow(self.parallel.device), []  # the steps since the last log line
                memory = FirstStepMemory(self.model, self.engine, self.parallel.device, self._allocated_before)
                while self.step < last_step:
                    started, learning_rate = time.perf_counter(), self.engine.get_lr()[0]  # the rate this step uses
                    profiler.before_step(self.step + 1)
                    batch = self.clock.batch(self.step)
                    self.steps.set_batch(batch)
                    run_step = lambda: self.steps.run(data_iter, self.step + 1)  # noqa: E731
                    result = run_step() if memory is None else memory.measured(run_step)
                    self.step += 1
                    position, self.consumed_samples = self.consumed_samples, advance(
                        self.consumed_samples, batch, self.spikes.skipped)
                    if memory is not None and (memory.steps == 2 or self.step == last_step):
                        self.reporter.memory(memory.report(), self.step, self.consumed_samples)  # with optimizer state
                        memory = None
                    profiler.after_step(self.step)
                    self.watchdog.progress(f"step {self.step}", self.step)
                    self.watchdog.limit("step")  # the first step ends the start-up (communicators built)
                    if after_step is not None:
                        after_step(result)
                    self.skips.count(self.step, result.outcome, position)
                    self._check_position(data_iter)
                    spike = self.spikes.judge(self.step, result)
                    # wall time between step starts: with a GPU's asynchrony one entry may hold part
                    # of another's work; their average over the window is exact (the log line syncs)
                    pending.append((result, {"iteration_time": time.perf_counter() - started,
                                             "learning_rate": learning_rate, "skipped_steps": self.skips.skipped,
                                             "global_batch_size": batch,
                                             "tokens_seen": self.tokens_seen(self.step)}))
                    if spike:
                        self.reporter.scalars("resilience", {"loss_spike": self.steps.guard.global_loss or math.nan},
                                              self.step, self.consumed_samples)
                    if spike and self.spikes.rolls_back:  # every rank decided alike
                        self._log_window(pending, window, data_iter)
                        pending = []
                        data_iter = self._roll_back(position, data_iter)
                        window.restart()
                        continue
                    self.watchdog.doing("agreeing on a stop (SIGTERM, time limit) with the other ranks", self.step)
                    stop = self.stops.agreed(self.step)
                    if self.step % self.cfg.logging.interval == 0 or self.step == last_step or stop:
                        self.watchdog.doing("reducing and logging metrics", self.step)
                        self._log_window(pending, window, data_iter)
                        pending = []
                    if self._evaluate_and_save(stop):
                        window.restart()  # an evaluation's or a save's time is not training's
                    if stop:
                        save_dir = self.cfg.checkpoint.save_dir
                        self.stopped = f"{stop}: saved step {self.step} in {save_dir}" if save_dir else stop
                        break
                else:
                    if not self.checkpointer.due(self.step):
                        self.checkpointer.save(self.step, self.consumed_samples)
                    if self.test_data is not None and self.step == t.train_steps:  # once, at the end of training
                        self.reporter.evaluation("test", self.evaluate(self.test_data), self.step, self.consumed_samples)
                self.checkpointer.wait()  # a stop or the end: the save in flight (checkpoint.async_save) published
            finally:
                profiler.close()
                self.reporter.close()
        return self.history

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on after `step` steps of this run, the phases before it included."""
        return self.checkpointer.tokens_before_phase + self.clock.tokens_before(step)

    def _token_state(self) -> dict:
        """What a checkpoint keeps of the token count (a later phase counts on from it)."""
        return {"tokens_before_phase": self.checkpointer.tokens_before_phase, "tokens_seen": self.tokens_seen(self.step)}

    def _roll_back(self, spike_position: int, data_iter):
        """Back to the run's latest checkpoint, past the spike's samples (spike_policy.py); the
        training iterator to go on with."""
        back = self.spikes.roll_back(self.checkpointer, self.reporter, self.step, spike_position)
        if back is None:
            return data_iter
        self.step, consumed_samples = back
        self.consumed_samples = skip_ahead(consumed_samples, self.spikes.skipped)
        return self.loaders.training(self.train_data, self.consumed_samples, self.spikes.skipped, self.step)

    def _check_position(self, data_iter) -> None:
        if data_iter.consumed_samples != self.consumed_samples:
            raise RuntimeError(f"rank {self.parallel.rank}: data position {data_iter.consumed_samples} "
                               f"samples, trainer {self.consumed_samples} after step {self.step}")

    def _log_window(self, pending: list[tuple[StepResult, dict]], window: ThroughputWindow, data_iter) -> None:
        """Reduce the window's steps (one collective, one host sync), keep them in the history, log.
        The same collective gathers every rank's own figures of the window (the straggler watch)."""
        steps = len(pending)
        phase_ms = self.timers.read(steps)
        figures = None if self.stragglers is None else self.stragglers.row(phase_ms, 1e3 * data_iter.wait_seconds / steps)
        reduced, table = reduce_window(self.parallel, [r.sums for r, _ in pending], [r.grad_norm for r, _ in pending],
                                       figures)
        self.history.extend(dict(metrics, **host) for metrics, (_, host) in zip(reduced, pending))
        perf = {"iteration_time": window.seconds() / steps, "data_wait_time": data_iter.wait_seconds / steps}
        data_iter.wait_seconds = 0.0
        perf.update(window.rates(*(sum(m[k] for m in reduced) for k in TOKEN_COUNTS),
                                 sum(host["global_batch_size"] for _, host in pending)))
        extra = {"params_norm": self.params_norm()}  # a collective: every rank computes it
        if self.cfg.train.precision == "fp16":  # the other wrappers report a constant 1.0
            extra["loss_scale"] = internals.loss_scale(self.engine)
        self.reporter.training(self.step, self.consumed_samples, self.history[-1], perf,
                               phase_ms if self.cfg.logging.timers else {}, extra,
                               None if table is None else self.stragglers.judge(table, self.step))

    def _evaluate_and_save(self, stop: str | None) -> bool:
        """The evaluation and the save due after this step, and the save a stop needs; whether any ran."""
        interval, step = self.cfg.eval.interval, self.step
        evaluated = bool(interval) and step % interval == 0
        if evaluated:
            self.reporter.evaluation("eval", self.evaluate(), step, self.consumed_samples)
        saved = self.checkpointer.due(step)
        if saved:
            self.checkpointer.save(step, self.consumed_samples)
        if stop:
            logger.info(f"{stop}: saving at step {step} and stopping; launch again to resume")
            if not saved:  # the same checkpoint twice would double the time a preemption waits
                self.checkpointer.save(step, self.consumed_samples)
        return evaluated or saved

