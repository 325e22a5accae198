"""Loader processes start from a forkserver, never forked from a rank running communication
threads: 300 loader starts (an evaluation's worth of batches from 2 worker processes each) in a
rank whose gloo process group keeps all-reducing on another thread, none hanging (tests/
_loader_stress_worker.py; run with START_METHOD=fork for the old path's behaviour)."""
import re

import pytest

from distributed import run_ranks

pytestmark = pytest.mark.slow


def test_300_loader_starts_beside_live_collectives():
    outputs = run_ranks(["tests/_loader_stress_worker.py", "300", "forkserver"], 2, timeout=600)
    done = re.search(r"300 starts in ([\d.]+) s; collectives (\d+)", outputs[0].stdout)
    assert done, outputs[0].stdout[-3000:]
    assert int(done[2]) > 300  # the collectives ran all along
