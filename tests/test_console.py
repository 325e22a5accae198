"""What the programs write for a batch log: plain progress lines every few seconds instead of a bar's
carriage-return redraws, and rank-prefixed, timestamped lines when several ranks share the output."""
import io
import re
import time

import pytest

import pretrain.observability.console as console
from pretrain.observability.console import PlainProgress, RankFormatter, progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(console.time, "monotonic", fake)
    return fake


def test_a_log_file_gets_a_plain_line_every_interval(clock):
    log = io.StringIO()  # not a terminal
    bar = progress(626, "fine-tuning rte", unit="step", file=log, interval=10.0)
    assert isinstance(bar, PlainProgress)
    for _ in range(626):
        clock.now += 0.1  # 62.6 s of steps
        bar.update(1)
        bar.set_postfix(loss="0.6931", epoch=1)
    bar.close()
    bar.close()  # closing twice writes nothing more
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 7  # at 10, 20, ..., 60 s, and the final count
    assert lines[0].startswith("fine-tuning rte: 100/626 (16%) | 10 step/s | 0:00:10 elapsed | ETA 0:00:52")
    assert lines[0].endswith("| loss=0.6931, epoch=1")
    assert lines[-1].startswith("fine-tuning rte: 626/626 (100%) | 10 step/s | 0:01:02 elapsed | loss=")


def test_scaled_units_and_a_disabled_display(clock):
    log = io.StringIO()
    bar = progress(2_500_000, "preprocess", unit="B", unit_scale=True, file=log, interval=5.0,
                   unit_divisor=1000, mininterval=0)  # tqdm's options are accepted and left to tqdm
    clock.now += 5
    bar.set_postfix_str("1,234 docs", refresh=False)  # as preprocessing does, before the update
    bar.update(1_000_000)
    assert log.getvalue() == "preprocess: 1.0M/2.5M B (40%) | 200.0k B/s | 0:00:05 elapsed | ETA 0:00:07 | 1,234 docs\n"
    quiet = io.StringIO()
    off = progress(10, "x", enabled=False, file=quiet, interval=0)
    off.update(10)
    off.close()
    assert quiet.getvalue() == ""


def test_a_terminal_gets_tqdm():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = progress(3, "x", file=Terminal())
    assert type(bar).__module__.startswith("tqdm")
    bar.close()


def test_lines_of_several_ranks_carry_time_and_rank():
    import logging

    record = logging.LogRecord("pretrain", logging.INFO, __file__, 1, "step 5/10 | loss 2.0\nsecond line", None, None)
    assert RankFormatter(0, 1).format(record) == "step 5/10 | loss 2.0\nsecond line"
    out = RankFormatter(3, 8).format(record).splitlines()
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank 3\] "
    assert re.fullmatch(stamp + r"step 5/10 \| loss 2\.0", out[0]), out
    assert re.fullmatch(stamp + "second line", out[1]), out


def test_the_programs_logging_shows_the_logging_ranks_information_and_every_ranks_warnings(capsys):
    """configure_logging: what the programs set for the library's loggers (a user embedding the
    library configures logging the usual way instead)."""
    import logging

    from pretrain.observability.console import configure_logging

    library = logging.getLogger("pretrain.training.trainer")
    try:
        configure_logging(rank=3, world_size=8, logging_rank=3)
        library.info("step 5/10 | loss 2.0\nsecond line")
        library.warning("memory planner failed")
        configure_logging(rank=2, world_size=8, logging_rank=3)
        library.info("not shown: another rank's information")
        library.warning("shown: another rank's warning")
        configure_logging()  # one process: as print() would show it
        logging.getLogger("finetune.finetuner").info("epoch 1 | accuracy 0.7")
        captured = capsys.readouterr()
    finally:
        for name in ("pretrain", "finetune"):  # back to a library nobody configured
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
    out, err = captured.out.splitlines(), captured.err.splitlines()
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank (\d)\] "
    assert [re.sub(stamp, r"\1: ", line) for line in out] == [
        "3: step 5/10 | loss 2.0", "3: second line", "epoch 1 | accuracy 0.7"], out
    assert [re.sub(stamp, r"\1: ", line) for line in err] == [
        "3: memory planner failed", "2: shown: another rank's warning"], err


def test_phase_times_are_exclusive(monkeypatch):
    """A phase inside another stops the outer one's clock (the all-reduce inside backward)."""
    import pretrain.observability.timers as timers

    now = [0.0]
    monkeypatch.setattr(timers.time, "perf_counter", lambda: now[0])
    t = timers.PhaseTimers(synchronize=lambda: None)

    class Engine:
        def allreduce_gradients(self):
            now[0] += 0.010

    engine = Engine()
    t.time_method(engine, "allreduce_gradients", "grad_reduce")
    for _ in range(2):  # two steps
        with t.phase("backward"):
            now[0] += 0.030
            engine.allreduce_gradients()
            now[0] += 0.005
        with t.phase("optimizer"):
            with t.phase("optimizer"):  # re-entered: counted once
                now[0] += 0.002
    assert t.read(steps=2) == pytest.approx({"backward": 35.0, "grad_reduce": 10.0, "optimizer": 2.0})
    assert t.read(steps=1) == {}


def test_loader_start_up_is_logged_apart_from_the_data_wait(caplog):
    """A training loader's first draw waits for its processes to start and build their first
    batches (seconds): one log line says how long, and the data wait of the first log window
    (wait_seconds) leaves it out, so that it does not read as a data bottleneck."""
    import logging

    import torch

    from pretrain.data.samples.synthetic import SyntheticDataset
    from pretrain.training.loaders import TrainingBatches

    batches = TrainingBatches(SyntheticDataset(64, 32, 5, 1000, seed=1), 0, 2, 0, 1, torch.device("cpu"),
                              num_workers=1)
    draws = []  # the seconds each draw took
    with caplog.at_level(logging.INFO, logger="pretrain.training.loaders"):
        try:
            for _ in range(4):
                began = time.perf_counter()
                next(batches)
                draws.append(time.perf_counter() - began)
        finally:
            batches.close()
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training loader started in ")]
    assert started == [f"training loader started in {batches.start_seconds:.1f} s (1 loader process; "
                       "not counted in the data wait)"], started
    assert draws[0] >= batches.start_seconds > 0  # the first draw holds the start-up ...
    assert batches.wait_seconds <= sum(draws[1:])  # ... and the data wait is the later draws' alone
    assert batches.consumed_samples == 8




@pytest.mark.parametrize("seconds_per_step, shown", [(3.0, "3 s/step"), (150.0, "150 s/step"), (0.4, "2.5 step/s"),
                                                      (0.1, "10 step/s"), (0.0008, "1,250 step/s")])
def test_a_slow_rate_is_not_rounded_to_zero(clock, seconds_per_step, shown):
    """Fine-tuning's steps take seconds on a CPU: the line said "0 step/s"."""
    log = io.StringIO()
    bar = progress(626, "fine-tuning rte", unit="step", file=log, interval=10.0)
    for _ in range(40):
        clock.now += seconds_per_step
        bar.update(1)
    bar.close()
    assert f" | {shown} | " in log.getvalue().splitlines()[0]
