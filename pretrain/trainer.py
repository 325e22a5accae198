"""The pretraining loop: model + optimizer under DeepSpeed, data, metrics, checkpoints."""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time

import deepspeed
import torch

from .checkpoint import exact as checkpoint_saving, load as checkpoint_loading
from .checkpoint.format import CheckpointError
from .common.atomic import atomic_outputs
from .common.errors import UserError
from .config import Config, build_deepspeed_config
from .distributed import device, internals
from .distributed.device import peak_memory_allocated as device_peak_memory
from .distributed.parallel import Parallel
from .model.bert import PretrainingLoss, build_model, init_weights
from .model.flops import encoder_flops_per_row, head_flops_per_sample
from .model.rng import RngTracker, seed_streams
from .observability.console import duration, rank_printer
from .observability.device_memory import MB, FirstStepMemory
from .observability.profiling import step_profiler
from .observability.timers import NoTimers, PhaseTimers
from .optim import Lamb, build_optimizer, layout_for_deepspeed, make_lr_scheduler
from .optim.groups import optimizer_param_groups
from .optim.guard import APPLIED, AT_MIN_SCALE, NonFiniteGuard, StepOutcome, classify, wrap_optimizer_step
from .optim.norms import counted_once, exact_clipping_for
from .plan import predict_rank_memory
from .resilience.watchdog import Watchdog, process_state
from .data.samples.batches import FixedMicroBatches, MicroBatchIterator
from .data.samples.provider import pretraining_datasets

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# how the console line names each phase of pretrain/observability/timers.py
PHASE_LABELS = {"data": "data", "forward": "fwd", "backward": "bwd", "forward_backward": "fwd+bwd",
                "grad_reduce": "reduce", "optimizer": "opt"}


class NonFiniteTraining(UserError, RuntimeError):
    """Too many steps in a row had a NaN/Inf loss or gradient: the run diverged."""


TOKEN_COUNTS = ("real_tokens", "computed_tokens")


def token_counts(micro_batch_inputs: list[tuple], like: torch.Tensor) -> torch.Tensor:
    """TOKEN_COUNTS of one step's micro-batches (float64 on `like`'s device, no host sync): real
    tokens (not padding; the padding mask and the packed sample ids are 0 there) and computed
    ones (rows x seq_length: what the layers ran on). Zeros on ranks that drew nothing."""
    real = torch.zeros((), dtype=torch.float64, device=like.device)
    computed = 0
    for inputs in micro_batch_inputs:
        real = real + (inputs[2] != 0).sum()
        computed += inputs[0].numel()
    return torch.stack([real, torch.full_like(real, computed)])


class Trainer:
    def __init__(self, cfg: Config, parallel: Parallel, log=None):
        self.started = time.monotonic()  # train.exit_duration_minutes counts from here
        self.cfg = cfg
        self.parallel = parallel
        log = log or rank_printer(parallel.rank, parallel.world_size)
        self.log = log if parallel.rank == parallel.logging_rank else (lambda *a, **k: None)
        self.step = 0
        self.consumed_samples = 0
        self._stop_requested = False
        self.stopped: str | None = None  # why train() stopped before train.train_steps, and what it saved
        self.steps_skipped = 0  # steps whose update was skipped (non-finite, or an fp16 overflow)
        self._bad_run: list[tuple[int, tuple[str, ...]]] = []  # the current run of non-finite steps, what was non-finite
        self._last_outcome: StepOutcome = APPLIED
        self.first_step_memory: list[dict] | None = None  # every rank's measured and planned memory, after step 2
        self.pipelined = parallel.pp_size > 1
        self.grad_accum = cfg.grad_accum_steps(parallel.world_size)

        # what the device held before this run (another run's leftovers in a test process): not its memory
        self._allocated_before = device.device_memory_allocated(parallel.device) or 0
        device.configure_math(parallel.device, cfg.train.tf32)
        unsupported = device.precision_problem(parallel.device, cfg.train.precision)
        if unsupported:
            raise device.DeviceError(unsupported)
        self.log(f"{device.describe(parallel)}, ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}")
        self.tracker = RngTracker(parallel.device)
        seed_streams(self.tracker, cfg.train.seed, parallel.tp_rank, parallel.pp_rank, parallel.dp_rank)
        self.loss_fn = PretrainingLoss(parallel.tp_group, parallel.tp_rank)
        self.ds_config = build_deepspeed_config(cfg, parallel.world_size)
        self.engine = self._build_engine()
        accumulation, reduction = internals.gradient_dtypes(self.engine)
        self.log(f"optimizer {cfg.optimizer.name} under DeepSpeed's {type(self.engine.optimizer).__name__}; gradients "
                 f"accumulated in {_dtype_name(accumulation)}, reduced in {_dtype_name(reduction)}, clipped "
                 f"{'exactly by the trainer' if self._exact_clipping is not None else 'by DeepSpeed'}")
        self.timers = self._phase_timers()

        # Rank 0 builds missing sample indices while the others wait; all then map the cache.
        self.train_data, self.valid_data, self.test_data = pretraining_datasets(
            cfg, is_builder=parallel.rank == 0, barrier=device.barrier, log=self.log)
        self.eval_results = EvalResults(cfg.train.eval_results) \
            if cfg.train.eval_results and parallel.rank == parallel.logging_rank else None
        self._evaluation_batches: dict[int, FixedMicroBatches] = {}  # loaders kept across evaluations, by dataset
        self._train_batches: MicroBatchIterator | None = None
        self.watchdog = Watchdog.for_job(cfg.train.hang_timeout_minutes, parallel, self._loader_report)
        self.writer = None
        if cfg.train.tensorboard_dir and parallel.rank == parallel.logging_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(cfg.train.tensorboard_dir)

    # ----------------------------------------------------------------------------- set-up
    def _build_engine(self):
        cfg, par = self.cfg, self.parallel
        padded_vocab = cfg.model.padded_vocab_size(par.tp_size)

        def make_model():
            model = build_model(cfg.model, padded_vocab, torch.float32, self.tracker, par.tp_group,
                                pipeline_topology=par.topology if self.pipelined else None, loss_fn=self.loss_fn,
                                binary_head=cfg.binary_head, packed=cfg.data.packing)
            init_weights(model, cfg.model.init_std, cfg.train.seed, cfg.model.vocab_size, par.tp_rank, par.tp_size)
            return model

        if cfg.parallel.zero_stage == 3:
            # Partition at construction, over the data-parallel group only: without it shards of
            # different TP ranks would be mixed and the loss silently wrong.
            with deepspeed.zero.Init(data_parallel_group=par.dp_group, config_dict_or_path=self.ds_config, mpu=par.mpu,
                                     remote_device=None, pin_memory=False):
                model = make_model()
        else:
            model = make_model()
        self.model = model

        o = cfg.optimizer
        hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        if o.name == "lamb":
            hyper["max_trust_ratio"] = o.max_trust_ratio
        optimizer = build_optimizer(o.name, optimizer_param_groups(model, o), **hyper)
        s = cfg.scheduler
        # Our non-finite check runs in every precision and ZeRO stage (DeepSpeed's wrappers add
        # their own, except at ZeRO-0 fp32); train.skip_nonfinite_steps decides whether it vetoes.
        guard = self.guard = NonFiniteGuard(par.device, self.loss_fn.all_finite, veto=cfg.train.skip_nonfinite_steps)
        guard.watch(model.parameters())
        self._exact_clipping = None  # ZeRO-0: our clipping, run inside the optimizer's step

        def scheduler(opt):
            steps = cfg.train.train_steps
            return make_lr_scheduler(opt, o.lr, s.warmup(steps), s.horizon(steps), s.decay, s.power, s.min_lr,
                                     hold=lambda: bool(guard.skipped()))

        def before_update():
            if self._exact_clipping is not None:
                internals.report_grad_norm(self.engine, self._exact_clipping())

        with internals.no_optimizer_steps(optimizer):  # the fp16/bf16 wrappers step once at construction
            wrap_optimizer_step(optimizer, guard.step_is_bad, before_update)  # inside no_optimizer_steps' own
            engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=self.ds_config,
                mpu=None if self.pipelined else par.mpu,  # the pipeline engine takes its grid from the topology
            )
        if par.dp_size == 1 and cfg.parallel.zero_stage == 0 and not self.pipelined:
            internals.skip_backward_allreduce(engine)
        self._exact_clipping = exact_clipping_for(engine, [lp.param for lp in counted_once(model, par)], par,
                                                  cfg.optimizer.grad_clip)
        if cfg.train.precision == "fp16":
            internals.let_loss_scaler_reach_minimum(engine)
        if isinstance(optimizer, Lamb):
            optimizer.set_layout(layout_for_deepspeed(engine, par.tp_group if par.tp_size > 1 else None,
                                                      par.dp_group if par.dp_size > 1 else None, par.device))
        return engine

    def _phase_timers(self) -> PhaseTimers | NoTimers:
        """train.timers: time each phase, also inside DeepSpeed (its gradient reduction, the
        optimizer wrapper's step, which the pipeline engine calls from train_batch)."""
        if not self.cfg.train.timers:
            return NoTimers()
        timers = PhaseTimers(lambda: device.synchronize(self.parallel.device))
        for method in ("allreduce_gradients", "buffered_allreduce_fallback"):
            timers.time_method(self.engine, method, "grad_reduce")
        timers.time_optimizer(internals.client_optimizer(self.engine))
        return timers

    def _loader_report(self) -> list[str]:
        """For the watchdog's dump: this rank's loader processes and what state each is in."""
        loaders = [("training", self._train_batches)] + [("evaluation", b) for b in self._evaluation_batches.values()]
        return [f"{name} loader process {pid}: {process_state(pid)}"
                for name, batches in loaders if batches is not None for pid in batches.worker_pids()]

    def _doing(self, phase: str) -> None:
        self.watchdog.doing(phase, self.step)

    def _progress(self, what: str) -> None:
        self.watchdog.progress(what, self.step)

    def _loader_workers(self) -> int:
        p = self.parallel
        # Middle pipeline stages never draw: no loader processes for them.
        return self.cfg.data.num_workers if (p.is_first_stage or p.is_last_stage) else 0

    @property
    def _pack_group(self) -> int:
        """data.packing packs a rank's share of a step (its micro-batches) together; 0 = unpacked."""
        return self.grad_accum if self.cfg.data.packing else 0

    def data_iterator(self, dataset, consumed_samples: int) -> MicroBatchIterator:
        p = self.parallel
        return MicroBatchIterator(dataset, consumed_samples, self.cfg.train.micro_batch_size, p.dp_rank, p.dp_size,
                                  p.device, num_workers=self._loader_workers(), pack_group=self._pack_group)

    def evaluation_batches(self, dataset) -> FixedMicroBatches:
        """The evaluation's micro-batches of `dataset`, its loader started once for every evaluation."""
        batches = self._evaluation_batches.get(id(dataset))
        if batches is None:
            p = self.parallel
            batches = self._evaluation_batches[id(dataset)] = FixedMicroBatches(
                dataset, self.cfg.train.eval_steps * self.grad_accum, self.cfg.train.micro_batch_size, p.dp_rank,
                p.dp_size, p.device, num_workers=self._loader_workers(), pack_group=self._pack_group)
        return batches

    def close_loaders(self) -> None:
        for batches in [self._train_batches, *self._evaluation_batches.values()]:
            if batches is not None:
                batches.close()
        self._train_batches = None
        self._evaluation_batches.clear()

    # ----------------------------------------------------------------------------- steps
    def train_step(self, data_iter) -> dict:
        """One optimizer step; its metrics reduced over the job (one collective, one host sync)."""
        sums, grad_norm = self._step(data_iter)
        return self._metrics([sums], [grad_norm])[0]

    def _step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        """One optimizer step: its loss sums and token counts (PretrainingLoss.METRICS, then
        TOKEN_COUNTS), left on the device unreduced, and the gradient norm as DeepSpeed's wrapper
        reports it (a device tensor, or a float or None, left as it is: a host number copied to
        a GPU would wait for the GPU)."""
        p = self.parallel
        self.guard.begin_step()
        overflows = internals.overflow_skips(self.engine)
        scale = internals.loss_scale(self.engine) if self.cfg.train.precision == "fp16" else None
        draws = not self.pipelined or p.is_first_stage or p.is_last_stage
        timers = self.timers
        if draws:
            position = getattr(data_iter, "consumed_samples", None)
            self._doing("data: waiting for the loader" + (f" (micro-batches from sample {position})"
                                                          if position is not None else ""))
        with timers.phase("data"):
            micro_batches = [next(data_iter) for _ in range(self.grad_accum)] if draws else []
        self._doing(f"step {self.step + 1}: forward, backward, gradient reduction, optimizer")
        if not self.pipelined or p.is_last_stage:
            self._scale_loss_to_global_batch([labels for _, labels in micro_batches])
        if self.pipelined:
            with timers.phase("forward_backward"):
                self.engine.train_batch(data_iter=iter(micro_batches))
            if not draws:
                # DeepSpeed never draws from a middle stage's iterator (PipelineEngine.
                # set_dataiterator); move its position on as the end stages' moved.
                data_iter.skip(self.grad_accum)
        else:
            for inputs, labels in micro_batches:
                with timers.phase("forward"):
                    loss = self.loss_fn(self.engine(inputs), labels)
                with timers.phase("backward"):
                    self.engine.backward(loss)
                with timers.phase("optimizer"):  # real work at the last micro-batch only
                    self.engine.step()
        deepspeed_skipped = internals.overflow_skips(self.engine) > overflows
        self._last_outcome = classify(self.guard.outcome(deepspeed_skipped), deepspeed_skipped,
                                      None if scale is None else self._scaler_can_lower(scale))
        # a skipped step's gradients had no finite norm (whatever the engine kept from before)
        grad_norm = float("inf") if self._last_outcome.skipped else self.engine.get_global_grad_norm()
        sums = self.loss_fn.drain(self.parallel.device)
        return torch.cat([sums, token_counts([inputs for inputs, _ in micro_batches], sums)]), grad_norm

    def _scaler_can_lower(self, scale: float) -> bool:
        """fp16: whether a gradient overflow at this loss scale lowers the scale (dynamic scaling
        above fp16.min_loss_scale), so that a later step may pass."""
        f = self.cfg.fp16
        return f.loss_scale == 0 and scale > f.min_loss_scale

    def _count_skip(self) -> None:
        """Count the step just taken if it was skipped; too many non-finite steps in a row end
        the run. fp16 loss-scale overflows are counted but never end it while the dynamic scaler
        can still lower its scale (it overflows several times in a row by design while it finds
        its scale); at fp16.min_loss_scale an overflow is a non-finite step like any other."""
        outcome = self._last_outcome
        if not outcome.skipped:
            self._bad_run = []
            return
        self.steps_skipped += 1
        if not outcome.counts:
            return
        self._bad_run.append((self.step, outcome.what))
        limit = self.cfg.train.max_consecutive_skips
        if len(self._bad_run) >= limit:
            what = sorted({w for _, found in self._bad_run for w in found})
            if AT_MIN_SCALE in what:  # says more than "gradients"
                what = [f"{AT_MIN_SCALE} ({self.cfg.fp16.min_loss_scale:g}, fp16.min_loss_scale)" if w == AT_MIN_SCALE
                        else w for w in what if w != "gradients"]
            first = self._bad_run[0][0]
            raise NonFiniteTraining(
                f"step {self.step}: non-finite {' and '.join(what)} in {limit} steps in a row (steps {first}-"
                f"{self.step}, train.max_consecutive_skips={limit}); every one was skipped, the weights are "
                f"those after step {first - 1}. Lower optimizer.lr or check the data near sample "
                f"{(first - 1) * self.cfg.train.global_batch_size}")

    def _scale_loss_to_global_batch(self, labels: list) -> None:
        """The step's MLM loss is a mean over every masked token of the global batch (see
        PretrainingLoss): count them over this rank's micro-batches and the data-parallel ranks,
        on the device (one small collective, no host sync)."""
        masked = torch.stack([PretrainingLoss.masked_tokens(micro) for micro in labels]).sum()
        if self.parallel.dp_size > 1:
            masked = device.all_reduce(masked, group=self.parallel.dp_group)
        self.loss_fn.scale_to_global_batch(masked, self.grad_accum * self.parallel.dp_size,
                                           self.cfg.train.global_batch_size)

    def _metrics(self, sums: list[torch.Tensor], grad_norms: list = ()) -> list[dict]:
        """Averages of the loss function's sums of several steps (or of one evaluation), each over
        its whole global batch (per masked token, per sequence), with this rank's gradient norm
        of each step: one collective and one host sync for all of them.

        Only the last stage computes the loss, and its TP ranks hold identical values: the
        (last stage, TP rank 0) ranks contribute, everyone receives the result.
        """
        p = self.parallel
        contributes = p.is_last_stage and p.tp_rank == 0
        reduced = device.all_reduce(torch.stack([s if contributes else torch.zeros_like(s) for s in sums]))
        on_device = [g.detach().reshape(1).to(reduced) for g in grad_norms if torch.is_tensor(g)]
        values = torch.cat([reduced.reshape(-1), *on_device]).tolist()
        width, count, losses = sums[0].numel(), len(sums), len(PretrainingLoss.METRICS)
        metrics = [PretrainingLoss.averages(values[i * width:i * width + losses]) for i in range(count)]
        for i, m in enumerate(metrics):  # a training step's token counts (an evaluation has none)
            m.update(zip(TOKEN_COUNTS, values[i * width + losses:(i + 1) * width]))
        read = iter(values[count * width:])
        for m, norm in zip(metrics, grad_norms):
            m["grad_norm"] = next(read) if torch.is_tensor(norm) else float("nan") if norm is None else float(norm)
        return metrics

    @torch.no_grad()
    def evaluate(self, dataset=None) -> dict:
        """Metrics over train.eval_steps global batches of `dataset` (default: the validation set),
        always its first ones: every evaluation sees the same samples."""
        self.engine.eval()
        data_iter = self.evaluation_batches(self.valid_data if dataset is None else dataset).one_pass()
        self.loss_fn.drain(self.parallel.device)
        for eval_step in range(self.cfg.train.eval_steps):
            self._doing(f"evaluation step {eval_step + 1}/{self.cfg.train.eval_steps}")
            if self.pipelined:
                self.engine.eval_batch(data_iter, compute_loss=True, bcast_loss=False)
            else:
                for _ in range(self.grad_accum):
                    inputs, labels = next(data_iter)
                    self.loss_fn(self.engine(inputs), labels)
            self._progress(f"evaluation step {eval_step + 1}")
        self.engine.train()
        return self._metrics([self.loss_fn.drain(self.parallel.device)])[0]

    def params_norm(self) -> float:
        """L2 norm of the whole logical model, each parameter counted once in any layout."""
        total = torch.zeros((), dtype=torch.float64, device=self.parallel.device)
        for lp in counted_once(self.model, self.parallel):
            zero3 = internals.is_zero3_param(lp.param)
            if not zero3 and self.parallel.dp_rank != 0:
                continue  # replicated over DP; a ZeRO-3 partition is this rank's own
            tensor = internals.zero3_partition(lp.param) if zero3 else lp.param
            total += tensor.detach().double().pow(2).sum()
        return math.sqrt(device.all_reduce(total).item())

    # ----------------------------------------------------------------------------- loop
    def _on_sigterm(self, signum, frame):
        self._stop_requested = True

    def _stop_agreed(self) -> str | None:
        """Why the ranks stop now, if they do: a SIGTERM on any rank, or train.exit_duration_minutes
        passed on any rank. Every rank calls it at the same steps (a collective)."""
        t = self.cfg.train
        if self.step % t.stop_check_interval:
            return None
        minutes = (time.monotonic() - self.started) / 60
        over_time = bool(t.exit_duration_minutes) and minutes >= t.exit_duration_minutes
        sigterm, late = device.reduce_floats([self._stop_requested, over_time], self.parallel.device, op="max")
        if sigterm:
            return "SIGTERM received"
        if late:
            return f"train.exit_duration_minutes ({t.exit_duration_minutes:g}) reached after {minutes:.1f} min"
        return None

    def save(self) -> None:
        if not self.cfg.train.save_dir:
            return
        self._doing(f"saving the checkpoint of step {self.step}")
        tag = checkpoint_saving.save_checkpoint(self.engine, self.cfg.train.save_dir, self.step, self.consumed_samples,
                                            self.cfg, self.parallel, self.tracker, self.cfg.train.keep_last)
        self.log(f"saved checkpoint {self.cfg.train.save_dir}/{tag}")
        self._progress(f"the save of step {self.step}")

    def resume(self) -> None:
        t = self.cfg.train
        found = None
        if t.load_dir:
            found = checkpoint_loading.resume(self.engine, self.model, t.load_dir, self.cfg, self.parallel,
                                              self.tracker, self.log)
            if found is None and t.load_dir != t.save_dir and not t.init_from:
                raise CheckpointError(f"no checkpoint in {t.load_dir} (no 'latest' file)")
        if found is None:
            if t.init_from:
                loaded = checkpoint_loading.init_from(self.engine, self.model, t.init_from, self.cfg, self.parallel,
                                                      t.init_optimizer_states)
                what = "weights and optimizer states" if t.init_optimizer_states else "weights"
                self.log(f"initialised {what} from {loaded}; starting at step 0")
            elif t.load_dir:
                self.log(f"no checkpoint in {t.load_dir} yet: starting from scratch")
            return
        self.step, self.consumed_samples = found
        if self.cfg.train.precision == "fp16":  # DeepSpeed's checkpoint carries the loss scaler object itself
            internals.let_loss_scaler_reach_minimum(self.engine)
        self.log(f"resumed from {self.cfg.train.load_dir} at step {self.step} ({self.consumed_samples} samples)")

    def train(self) -> list[dict]:
        """Run to train.train_steps; returns the per-step metrics (for tests and callers)."""
        cfg, t = self.cfg, self.cfg.train
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if _main_thread() else None
        self.watchdog.start()
        self._doing("resuming" if t.load_dir else "start-up")
        self.resume()
        self._progress("start-up")
        data_iter = self._train_batches = self.data_iterator(self.train_data, self.consumed_samples)
        history = []
        last_step = t.train_steps if not t.exit_after_steps else min(t.train_steps, self.step + t.exit_after_steps)
        window_start, window = time.perf_counter(), []  # the steps since the last log line
        profiler = step_profiler(t, self.parallel.rank, self.parallel.device)
        memory = FirstStepMemory(self.model, self.engine, self.parallel.device, self._allocated_before)  # logged once
        try:
            while self.step < last_step:
                started = time.perf_counter()
                learning_rate = self.engine.get_lr()[0]  # the rate this step uses
                profiler.before_step(self.step + 1)
                if memory is not None and memory.steps == 0:
                    with memory.meter.hooks():
                        step_metrics = self._step(data_iter)  # stays on the device until the log line
                else:
                    step_metrics = self._step(data_iter)
                self.step += 1
                if memory is not None:
                    memory.step_done()
                    if memory.steps == 2 or self.step == last_step:  # the device peak of a step with optimizer state
                        self._log_memory(memory.report())
                        memory = None
                profiler.after_step(self.step)
                self.consumed_samples += t.global_batch_size
                self._progress(f"step {self.step}")
                self._count_skip()
                if data_iter.consumed_samples != self.consumed_samples:
                    raise RuntimeError(f"rank {self.parallel.rank}: data position {data_iter.consumed_samples} "
                                       f"samples, trainer {self.consumed_samples} after step {self.step}")
                # wall time between step starts: with a GPU's asynchrony one entry may hold part of
                # another's work; their average over the window is exact (the log line syncs)
                window.append((step_metrics, {"iteration_time": time.perf_counter() - started,
                                              "learning_rate": learning_rate, "skipped_steps": self.steps_skipped}))
                self._doing("agreeing on a stop (SIGTERM, time limit) with the other ranks")
                stop = self._stop_agreed()
                self._doing("reducing and logging metrics")
                if self.step % t.log_interval == 0 or self.step == last_step or stop:
                    reduced = self._metrics([sums for (sums, _), _ in window], [norm for (_, norm), _ in window])
                    history.extend(dict(metrics, **host) for metrics, (_, host) in zip(reduced, window))
                    elapsed = time.perf_counter() - window_start
                    waited, data_iter.wait_seconds = data_iter.wait_seconds, 0.0
                    tokens = {k: sum(m[k] for m in reduced) / len(window) for k in TOKEN_COUNTS}
                    self._log_train(history[-1], elapsed / len(window), waited / len(window),
                                    self.timers.read(len(window)), tokens)
                    window_start, window = time.perf_counter(), []
                if t.eval_interval and self.step % t.eval_interval == 0:
                    self._log_eval("eval", self.evaluate())
                saved = bool(t.save_interval) and self.step % t.save_interval == 0
                if saved:
                    self.save()
                if stop:
                    self.log(f"{stop}: saving at step {self.step} and stopping; launch again to resume")
                    if not saved:  # the same checkpoint twice would double the time a preemption waits
                        self.save()
                    self.stopped = f"{stop}: saved step {self.step} in {t.save_dir}" if t.save_dir else stop
                    break
            else:
                if not (t.save_interval and self.step % t.save_interval == 0):
                    self.save()
                if self.test_data is not None and self.step == t.train_steps:
                    self._log_eval("test", self.evaluate(self.test_data))  # once, at the end of training
        finally:
            profiler.close()
            self.close_loaders()
            self.watchdog.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self.writer is not None:
                self.writer.flush()
        return history

    # ----------------------------------------------------------------------------- logging
    def _scalars(self, prefix: str, values: dict) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, self.step)
            self.writer.add_scalar(f"{prefix}-vs-samples/{name}", value, self.consumed_samples)

    def _log_train(self, metrics: dict, seconds_per_step: float, data_wait_per_step: float,
                   phase_ms: dict[str, float], tokens: dict[str, float]) -> None:
        """`tokens`: TOKEN_COUNTS per step over the window. Speed is given in real (non-padding)
        tokens beside the computed ones; the model FLOPs are those of the rows computed (the
        encoder) and of the samples (the heads)."""
        t = self.cfg.train
        rows = tokens["computed_tokens"] / self.cfg.data.seq_length  # = global batch unless packed
        flops = encoder_flops_per_row(self.cfg) * rows + head_flops_per_sample(self.cfg) * t.global_batch_size
        perf = {
            "real_tokens_per_second": tokens["real_tokens"] / seconds_per_step,
            "tokens_per_second": tokens["computed_tokens"] / seconds_per_step,  # padding included
            "real_token_share": tokens["real_tokens"] / max(tokens["computed_tokens"], 1.0),
            "samples_per_second": t.global_batch_size / seconds_per_step,
            "model_tflops_per_rank": flops / seconds_per_step / 1e12 / self.parallel.world_size,
            "iteration_time": seconds_per_step,
            "data_wait_time": data_wait_per_step,  # the part of iteration_time spent waiting for batches
            "peak_memory_gb": _peak_memory_gb(self.parallel.device),
        }
        params_norm = self.params_norm()  # a collective: every rank computes it
        train = {k: metrics[k] for k in ("loss", "lm_loss", *self._nsp_keys, "mlm_accuracy", "learning_rate",
                                          "grad_norm", "skipped_steps")}
        train["params_norm"] = params_norm
        if self.cfg.train.precision == "fp16":  # the other wrappers report a constant 1.0
            train["loss_scale"] = internals.loss_scale(self.engine)
        self._scalars("train", train)
        self._scalars("perf", perf)
        self._scalars("time", {f"{phase}_ms": ms for phase, ms in phase_ms.items()})
        phases = " ".join(f"{PHASE_LABELS[phase]} {ms:.0f}" for phase, ms in phase_ms.items())
        eta = seconds_per_step * (t.train_steps - self.step)
        nsp = f"| nsp {metrics['nsp_loss']:.4f} " if self.cfg.binary_head else ""
        self.log(
            f"step {self.step}/{t.train_steps} | loss {metrics['loss']:.4f} | lm {metrics['lm_loss']:.4f} "
            f"{nsp}| mlm acc {metrics['mlm_accuracy']:.3f} | lr {metrics['learning_rate']:.3e} "
            f"| grad norm {metrics['grad_norm']:.3f} | {perf['real_tokens_per_second']:.0f} real tok/s "
            f"({perf['tokens_per_second']:.0f} computed, {100 * perf['real_token_share']:.0f}% real) "
            f"| data wait {1e3 * data_wait_per_step:.0f} ms/step "
            f"| {perf['model_tflops_per_rank'] * 1e3:.1f} GFLOP/s/rank | ETA {duration(eta)}"
            + (f" | skipped {metrics['skipped_steps']}" if metrics["skipped_steps"] else "")
            + (f" | ms/step: {phases}" if phases else ""),
            flush=True,
        )

    def _log_memory(self, measured: dict[str, int]) -> None:
        """Every rank's measured breakdown beside the planner's prediction for it, one line per
        rank on the logging rank (one collective, once); kept in `first_step_memory`."""
        try:
            planned = predict_rank_memory(self.cfg, self.parallel.world_size, self.parallel.pp_rank,
                                          self.parallel.device.type, self.parallel.dp_rank).breakdown()
        except Exception as error:  # a planner bug must not stop a training run: say it, go on
            planned = {}
            self.log(f"memory planner failed on rank {self.parallel.rank}: {type(error).__name__}: {error}")
        self.first_step_memory = device.all_gather_object({"measured": measured, "planned": planned})
        for rank, report in enumerate(self.first_step_memory):
            self.log(f"memory of rank {rank} in step {self.step}: "
                     + " | ".join(_memory_item(label, key, report) for key, label in MEMORY_ITEMS
                                  if key in report["measured"]))
        mine = self.first_step_memory[self.parallel.rank]
        self._scalars("memory", {f"{key}_mb": value / MB for key, value in mine["measured"].items()})
        self._scalars("memory", {f"planned_{key}_mb": value / MB for key, value in mine["planned"].items()})

    @property
    def _nsp_keys(self) -> tuple[str, ...]:
        """The next-sentence metrics, which a model without the binary head does not have."""
        return ("nsp_loss", "nsp_accuracy") if self.cfg.binary_head else ()

    def _log_eval(self, split: str, metrics: dict) -> None:
        """One evaluation ("eval": the validation set, "test"): console, TensorBoard, eval_results."""
        metrics = {k: v for k, v in metrics.items() if not k.startswith("nsp_") or k in self._nsp_keys}
        metrics["perplexity"] = math.exp(min(metrics["lm_loss"], 50.0))
        self._scalars(split, metrics)
        nsp = (f" | nsp {metrics['nsp_loss']:.4f}", f" | nsp acc {metrics['nsp_accuracy']:.3f}") \
            if self.cfg.binary_head else ("", "")
        self.log(
            f"{split} at step {self.step} | lm {metrics['lm_loss']:.4f} | perplexity {metrics['perplexity']:.2f}"
            f"{nsp[0]} | mlm acc {metrics['mlm_accuracy']:.3f}{nsp[1]}",
            flush=True,
        )
        if self.eval_results is not None:
            self.eval_results.add("valid" if split == "eval" else split, self.step, self.consumed_samples, metrics)


class EvalResults:
    """train.eval_results: a JSON file {"valid": [...], "test": [...]} of {step, consumed_samples,
    metrics} entries, read once (a resumed run keeps what came before), rewritten atomically after
    each evaluation. Entries at a step being evaluated again (after a crash past them) are replaced."""

    def __init__(self, path: str):
        self.path = path
        self.results: dict | None = None

    def _read(self) -> dict:
        results = {"valid": [], "test": []}
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    results.update(json.load(f))
            except (OSError, ValueError) as err:
                raise UserError(f"train.eval_results: {self.path} cannot be read as JSON ({err}); move it away") from None
        return results

    def add(self, split: str, step: int, consumed_samples: int, metrics: dict) -> None:
        if self.results is None:
            self.results = self._read()
        entries = [e for e in self.results.get(split, []) if e["step"] < step]
        self.results[split] = entries + [{"step": step, "consumed_samples": consumed_samples, "metrics": metrics}]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with atomic_outputs([self.path]) as temps, open(temps[self.path], "w", encoding="utf-8") as f:
            json.dump(self.results, f, indent=1)


# FirstStepMemory's figures as the log line names them
MEMORY_ITEMS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
                ("activations_peak", "activations peak"), ("device_peak", "device peak"))


def _memory_item(label: str, key: str, report: dict) -> str:
    text = f"{label} {report['measured'][key] / MB:,.1f} MB"
    if key in report["planned"]:
        text += f" (planned {report['planned'][key] / MB:,.1f})"
    return text


def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in PRECISION_DTYPES.items() if d == dtype), str(dtype))


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _peak_memory_gb(device: torch.device) -> float:
    """The device's allocated peak (GPUs, fakegpu); the process's peak resident memory on the CPU."""
    peak = device_peak_memory(device)
    if peak is not None:
        return peak / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30
