"""Sequence packing of pretraining samples (pretrain/data/samples/packing.py): where every sample's
tokens, positions and labels land, checked against the unpacked samples themselves."""
import numpy as np
import pytest

from pretrain.data.samples.batches import collate, collate_packed
from pretrain.data.samples.packing import PackingError, deal_rows, first_fit_decreasing, pack, packing_efficiency
from pretrain.data.samples.synthetic import SyntheticDataset


def samples(count=24, seq=64, seed=3):
    data = SyntheticDataset(250, seq, 6, 1000, seed=seed, min_fraction=0.1)
    return [data[i] for i in range(count)]


@pytest.mark.parametrize("parts", [1, 3])
def test_every_sample_is_in_its_row_as_it_was_unpacked(parts):
    """A step's share of 24 samples packed and dealt out to `parts` micro-batches: each sample
    once, with its tokens, positions from 0, [CLS], masked tokens and labels."""
    batch = samples()
    padded = collate(batch)
    lengths = padded["padding_mask"].sum(1)
    micro_batches = collate_packed(batch, parts)
    assert len(micro_batches) == parts
    rows = [mb["input_ids"].shape[0] for mb in micro_batches]
    seq = micro_batches[0]["input_ids"].shape[1]
    assert -(-int(lengths.sum()) // seq) <= sum(rows) < len(batch)
    assert max(rows) - min(rows) <= 1, rows  # dealt out evenly
    seen = []  # window sample of each packed one, by content
    for packed in micro_batches:
        first = len(seen)
        flat = {name: packed[name].reshape(-1) for name in ("input_ids", "token_type_ids", "sample_ids", "position_ids")}
        count = packed["nsp_label"].numel()
        assert int(flat["sample_ids"].max()) == count
        for n in range(count):
            start = int(packed["cls_positions"][n])
            n_tokens = int((flat["sample_ids"] == n + 1).sum())
            span = slice(start, start + n_tokens)
            assert start // seq == (start + n_tokens - 1) // seq, f"sample {n} crosses a row boundary"
            assert set(flat["sample_ids"][span].tolist()) == {n + 1}
            i = next(i for i in range(len(batch)) if i not in seen and int(lengths[i]) == n_tokens
                     and flat["input_ids"][span].tolist() == padded["input_ids"][i, :n_tokens].tolist())
            seen.append(i)
            assert flat["token_type_ids"][span].tolist() == padded["token_type_ids"][i, :n_tokens].tolist()
            assert flat["position_ids"][span].tolist() == list(range(n_tokens))
            # the masked positions point at the same tokens, the labels are the sample's own
            assert flat["input_ids"][packed["masked_positions"][n]].tolist() == \
                padded["input_ids"][i][padded["masked_positions"][i]].tolist()
            for name in ("masked_labels", "masked_weights", "nsp_label"):
                assert packed[name][n].equal(padded[name][i])
        assert not flat["input_ids"][flat["sample_ids"] == 0].any()  # the rest is padding
        assert seen[first:] == sorted(seen[first:])  # a micro-batch's samples in window order
    assert sorted(seen) == list(range(len(batch)))


def test_rows_are_dealt_to_every_micro_batch():
    assert deal_rows([[0, 1, 2]], 3) == [[[0]], [[2]], [[1]]]
    assert deal_rows([[0], [1], [2], [3], [4]], 2) == [[[0], [1]], [[2], [3], [4]]]
    with pytest.raises(PackingError, match="1 samples cannot fill 2 micro-batches"):
        deal_rows([[0]], 2)


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
