"""Sequence packing of pretraining samples (pretrain/samples/packing.py): where every sample's
tokens, positions and labels land, checked against the unpacked samples themselves."""
import numpy as np
import pytest

from pretrain.samples.batches import collate, collate_packed
from pretrain.samples.packing import PackingError, first_fit_decreasing, pack, packing_efficiency
from pretrain.samples.synthetic import SyntheticDataset


def samples(count=24, seq=64, seed=3):
    data = SyntheticDataset(250, seq, 6, 1000, seed=seed, min_fraction=0.1)
    return [data[i] for i in range(count)]


def test_every_sample_is_in_its_row_as_it_was_unpacked():
    batch = samples()
    packed, padded = collate_packed(batch), collate(batch)
    rows, seq = packed["input_ids"].shape
    lengths = padded["padding_mask"].sum(1)
    assert -(-int(lengths.sum()) // seq) <= rows < len(batch)
    flat = {name: packed[name].reshape(-1) for name in ("input_ids", "token_type_ids", "sample_ids", "position_ids")}
    for i in range(len(batch)):
        n, start = int(lengths[i]), int(packed["cls_positions"][i])
        span = slice(start, start + n)
        assert start // seq == (start + n - 1) // seq, f"sample {i} crosses a row boundary"
        assert flat["input_ids"][span].tolist() == padded["input_ids"][i, :n].tolist()
        assert flat["token_type_ids"][span].tolist() == padded["token_type_ids"][i, :n].tolist()
        assert flat["position_ids"][span].tolist() == list(range(n))
        assert set(flat["sample_ids"][span].tolist()) == {i + 1}
        assert flat["input_ids"][start] == padded["input_ids"][i, 0]  # its [CLS]
        # the masked positions point at the same tokens, the labels are the unpacked ones
        assert flat["input_ids"][packed["masked_positions"][i]].tolist() == \
            padded["input_ids"][i][padded["masked_positions"][i]].tolist()
    for name in ("masked_labels", "masked_weights", "nsp_label"):
        assert packed[name].equal(padded[name])
    # every real token once, the rest padding (sample id 0, token 0)
    assert int((flat["sample_ids"] > 0).sum()) == int(lengths.sum())
    assert not flat["input_ids"][flat["sample_ids"] == 0].any()


def test_rows_are_a_pure_function_of_the_lengths():
    assert first_fit_decreasing([5, 3, 8, 2, 6, 4], 10) == [[2, 3], [4, 5], [0, 1]]
    assert first_fit_decreasing([10, 10], 10) == [[0], [1]]
    assert first_fit_decreasing([3, 3, 3], 10) == [[0, 1, 2]]
    lengths = np.random.default_rng(0).integers(8, 65, size=200)
    rows = first_fit_decreasing(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert rows == first_fit_decreasing(lengths.tolist(), 64)
    # first-fit decreasing is within 11/9 OPT + 1 rows; here (half the samples longer than half a
    # row, so at most one of them per row) within 7% of the token bound
    assert len(rows) <= int(np.ceil(lengths.sum() / 64) * 1.07)
    assert packing_efficiency(lengths, 64) == pytest.approx(lengths.sum() / (64 * len(rows)))


def test_padding_before_real_tokens_is_refused():
    bad = samples(2)
    bad[1]["padding_mask"] = bad[1]["padding_mask"][::-1].copy()
    with pytest.raises(PackingError, match="sample 1 of the micro-batch has padding before real tokens"):
        pack(bad)
