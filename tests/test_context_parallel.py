"""Context parallelism (pretrain/model/context_parallel.py): the attention of each rank's share of
a row equals its share of one process's attention over the whole row, forward and backward, at CP2
and CP4, for packed documents crossing the ranks' boundaries and one long document, global and
local layers; local layers exchange only the halo (half a window with each neighbour) unless the
shares are shorter than it.
"""
import json

import pytest

from distributed import run_ranks


@pytest.fixture(scope="module")
def attention_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "attention.json"
    run_ranks(["tests/_cp_attention_worker.py", str(out)], 4, timeout=300)
    return json.loads(out.read_text())


def test_each_share_of_the_attention_equals_one_process(attention_results):
    from _cp_attention_worker import CASES, HEADS, DIM

    assert len(attention_results) == 2 * len(CASES)
    for case, r in attention_results.items():
        cp = int(case.split("/")[0][2:])
        assert r["max_abs"] < 1e-10, (case, r)  # float64: the same sums in another order
        assert r["scale"] > 0.1, case
        # the split took effect: rank 0 computed its share of the queries only
        assert r["queries"] == r["share"] == -(-r["tokens"] // cp), case
        lengths, half_window = CASES[case.split("/")[1]]
        if half_window is not None and r["share"] >= half_window:
            # rank 0 has one neighbour: half a window of keys, of values (forward), of their gradients (backward)
            assert r["exchanged"] == [half_window * HEADS * DIM] * 4, (case, r["exchanged"])
        else:
            assert r["exchanged"] == [], case
        assert sum(r["work"]) == sum(n * n for n in lengths), case
