"""The one base class of the errors a user can act on (kept import-free: every program loads it).

Each library error class that reports bad input derives from `UserError` and keeps its old second
base (ValueError, RuntimeError), so `except ValueError` code keeps working. The command-line spine
(pretrain/cli.py) prints a UserError as its message alone and exits with its `exit_status`;
anything else that escapes a program is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input or a state the user can fix. The message names the file, key or line; programs
    print it as one line (no traceback) and exit 1."""

    exit_status = 1


class UsageError(UserError):
    """The command line asks for something impossible, found after argparse accepted it: nothing
    has started. Exit 2, the status argparse gives its own usage errors."""

    exit_status = 2
