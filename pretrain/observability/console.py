"""What the programs write for a person or a batch log to read.

- `progress`: a tqdm bar on a terminal; anywhere else (a log file, SLURM's output, a pipe) one
  plain line every `interval` seconds, never carriage-return updates (a bar redrawn into a file
  leaves hundreds of partial lines).
- `configure_logging`: how the programs show the library's log records (loggers `pretrain.*` and
  `finetune.*`, one per module): information on stdout, warnings and errors on stderr, as they
  are with one rank; with several ranks sharing one output, every line starts with the time and
  the rank that wrote it, and only the logging rank's information is shown (every rank's
  warnings are). A program embedding the library configures logging its own way instead.
"""
from __future__ import annotations

import datetime
import logging
import sys
import time
from typing import TextIO


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _two_digits(value: float) -> str:
    """2.5, 10, 1,234: two significant digits, or the whole number from 10 on."""
    return f"{value:.2g}" if value < 9.95 else f"{value:,.0f}"


class PlainProgress:
    """The subset of tqdm's interface the programs use, as plain periodic lines:

        fine-tuning rte: 120/626 (19%) | 3.2 it/s | 0:00:37 elapsed | ETA 0:02:38 | loss 0.61
    """

    def __init__(self, total: int | float, desc: str, unit: str = "it", unit_scale: bool = False,
                 file: TextIO | None = None, interval: float = 10.0, disable: bool = False):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.file, self.interval, self.disable = file or sys.stderr, interval, disable
        self.n = 0
        self.postfix = ""
        self.started = self._last = time.monotonic()
        self._written_at = None  # n of the last line written

    def _amount(self, value: float) -> str:
        if not self.unit_scale:
            return f"{value:,.0f}"
        for prefix in ("", "k", "M", "G", "T"):
            if abs(value) < 1000:
                return f"{value:.1f}{prefix}"
            value /= 1000
        return f"{value:.1f}P"

    def _rate(self, rate: float) -> str:
        """Units per second to two significant digits; below one per second, seconds per unit (as
        tqdm shows a slow rate): a fine-tuning step of 3 s reads "3 s/step", never "0 step/s"."""
        if self.unit_scale or rate == 0:
            return f"{self._amount(rate)} {self.unit}/s"
        if rate >= 1:
            return f"{_two_digits(rate)} {self.unit}/s"
        return f"{_two_digits(1 / rate)} s/{self.unit}"

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        done = f"{self._amount(self.n)}/{self._amount(self.total)}{' ' + self.unit if self.unit_scale else ''}"
        parts = [f"{self.desc}: {done} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.desc}: {done}",
                 self._rate(rate), f"{duration(elapsed)} elapsed"]
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {duration((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return " | ".join(parts)

    def _write(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self._last, self._written_at = time.monotonic(), self.n

    def update(self, n: int | float = 1) -> None:
        self.n += n
        if not self.disable and time.monotonic() - self._last >= self.interval:
            self._write()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        if not self.disable and self._written_at != self.n:
            self._write()  # the final count, once
        self.disable = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int | float, desc: str, enabled: bool = True, unit: str = "it", unit_scale: bool = False,
             file: TextIO | None = None, interval: float = 10.0, **bar_options):
    """A progress display for `total` units: tqdm on a terminal, PlainProgress otherwise."""
    file = file or sys.stderr
    if enabled and _is_terminal(file):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=file, dynamic_ncols=True,
                    **bar_options)
    return PlainProgress(total, desc, unit=unit, unit_scale=unit_scale, file=file, interval=interval,
                         disable=not enabled)


LIBRARY_LOGGERS = ("pretrain", "finetune")


def _stamped(text: str, rank: int) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return "\n".join(f"[{stamp} rank {rank}] {line}" for line in text.split("\n"))


class RankFormatter(logging.Formatter):
    """The message as it is with one rank; each line prefixed "[time rank N] " with several."""

    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return _stamped(text, self.rank) if self.world_size > 1 else text


class _ConsoleHandler(logging.StreamHandler):
    """A handler writing to sys.stdout or sys.stderr as they are when a record comes (a test's
    capture or a redirected stream gets it), flushed after each record (batch logs)."""

    def __init__(self, stream_name: str):
        super().__init__()
        self.stream_name = stream_name

    @property
    def stream(self):
        return getattr(sys, self.stream_name)

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ sets it; the property decides
        pass


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def configure_logging(rank: int = 0, world_size: int = 1, logging_rank: int | None = None) -> None:
    """The programs' logging of the library (see the module's docstring); called again once the
    rank is known, it replaces what it set before. `logging_rank`: the rank whose information is
    shown (None: every rank's)."""
    formatter = RankFormatter(rank, world_size)
    out, err = _ConsoleHandler("stdout"), _ConsoleHandler("stderr")
    out.addFilter(_BelowWarning())
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
            logger.removeHandler(old)
        logger.addHandler(out)
        logger.addHandler(err)
        logger.setLevel(logging.INFO if logging_rank is None or rank == logging_rank else logging.WARNING)
        logger.propagate = False  # the program prints them; a root handler would print them twice
