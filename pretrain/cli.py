"""Pieces every command-line entry point shares (kept free of heavy imports: --help stays fast)."""
from __future__ import annotations

import argparse


def accept_launcher_args(parser: argparse.ArgumentParser) -> None:
    """The deepspeed launcher appends --local_rank=N to every program's arguments; the rank is
    read from the environment (LOCAL_RANK), so the flag is accepted and ignored."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
