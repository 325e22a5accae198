"""Invariant 3: our model computes what transformers' BertForPreTraining computes (1e-5), with
padded batches and with packed ones (several samples per row, each HF's result on it alone)."""
import json

import pytest

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_loss_match_hugging_face(tmp_path, tp):
    out = tmp_path / "parity.json"
    run_ranks(["tests/_parity_worker.py", str(out)], tp, timeout=600)
    r = json.loads(out.read_text())
    assert r["tp"] == tp
    # the padded batch was computed as one row of its real tokens (padding never reaches a layer)
    assert r["layer_input_shape"][:2] == [1, r["real_tokens"]] and r["real_tokens"] < 0.9 * r["rows_x_seq"], r
    assert r["mlm_scale"] > 0.1  # logits are not trivially zero
    assert r["mlm_max_abs"] < 1e-5
    assert r["nsp_max_abs"] < 1e-5
    assert r["loss"] == pytest.approx(r["hf_loss"], rel=1e-5, abs=1e-6)
    # packed rows (data.packing): 8 samples in fewer rows, each sample's logits and losses HF's
    assert r["packed_rows"] < r["packed_samples"]
    for key in ("packed_mlm_max_abs", "packed_nsp_max_abs", "packed_mlm_loss_max_abs", "packed_nsp_loss_max_abs"):
        assert r[key] < 1e-5, (key, r[key])
    # the pooled [CLS] of sequence-level fine-tuning (its last layer computed for [CLS] only)
    assert r["pooled_scale"] > 0.1 and r["pooled_max_abs"] < 1e-5
    if r["padded_vocab_max"] is not None:  # padded vocabulary entries never receive probability
        assert r["padded_vocab_max"] < -1e30
