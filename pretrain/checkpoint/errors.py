"""The checkpoint package's error (import-free, like filenames.py: the pre-start checks raise it
before torch is loaded)."""
from __future__ import annotations

from ..common.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read, written or used as asked (the message names the file)."""
