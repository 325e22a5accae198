"""Loader processes start from a forkserver, never forked from a rank running communication
threads: 100 loader starts (an evaluation's worth of batches from 2 worker processes each) in a
rank whose gloo process group keeps all-reducing on another thread, none hanging and none of
them a child of the rank (tests/_loader_stress_worker.py; with START_METHOD fork, the old path,
the parent check fails at the first start)."""
import re

import pytest

from distributed import run_ranks

pytestmark = pytest.mark.slow


def test_loader_starts_beside_live_collectives():
    outputs = run_ranks(["tests/_loader_stress_worker.py", "100", "forkserver"], 2, timeout=600)
    done = re.search(r"100 starts in ([\d.]+) s; collectives (\d+)", outputs[0].stdout)
    assert done, outputs[0].stdout[-3000:]
    assert int(done[2]) > 100  # the collectives ran all along
