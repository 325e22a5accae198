"""tools/embed.py against sentence-transformers (a test-only dependency): a BERT and a ModernBERT
export (tools/convert_checkpoint.py's directory, mean pooling in its sentence-transformers config)
embed a file of texts to what `SentenceTransformer(path).encode()` gives, within 1e-5, and
normalised as `normalize_embeddings=True`; a text longer than the trained length is cut and counted;
an empty line and an existing output file are refused naming them."""
import json

import numpy as np
import pytest

from distributed import run_python
from test_hf_directories import save_directory, tiny_model
from test_modernbert import saved_model

pytestmark = pytest.mark.slow

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the cats are playing",
         "the mat " * 40, "a", "park dog cat the a mat sat"]


def export(tmp_path, architecture: str):
    """A transformers directory as tools/convert_checkpoint.py writes it (with its sentence-transformers
    files), from a tiny random model."""
    from pretrain.checkpoint.hf import read_hf, write_hf

    if architecture == "bert":
        from transformers import BertModel

        source = save_directory(tmp_path / "hf-bert", tiny_model(BertModel), lowercase=False)
    else:
        _, source = saved_model(tmp_path, "every2-window8")
    ckpt = read_hf(str(source))
    ckpt.trained_length = 16  # as if trained on 16-token rows: the fourth text is cut
    out = tmp_path / f"export-{architecture}"
    write_hf(ckpt, str(out), architecture="BertModel" if architecture == "bert" else "ModernBertModel")
    return out


@pytest.mark.parametrize("architecture", ["bert", "modernbert"])
def test_embeddings_equal_sentence_transformers_encode(tmp_path, architecture):
    from sentence_transformers import SentenceTransformer

    model_dir = export(tmp_path, architecture)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    outputs = {}
    for normalize in (False, True):
        out = tmp_path / f"emb-{normalize}.npy"
        done = run_python(["tools/embed.py", "--checkpoint", str(model_dir), "--input", str(texts), "--output", str(out),
                           "--batch-size", "4", *(["--normalize"] if normalize else [])], timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "embedded 6 texts" in done.stdout and "at most 16 tokens; 1 cut" in done.stdout, done.stdout
        outputs[normalize] = np.load(out)

    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    assert st.max_seq_length == 16
    for normalize, ours in outputs.items():
        theirs = st.encode(TEXTS, batch_size=3, normalize_embeddings=normalize, convert_to_numpy=True)
        assert ours.shape == theirs.shape and ours.shape[0] == len(TEXTS)
        assert np.allclose(ours, theirs, atol=1e-5), np.abs(ours - theirs).max()
    assert np.allclose(np.linalg.norm(outputs[True], axis=1), 1.0, atol=1e-6)

    # bad input is named, nothing written
    (tmp_path / "bad.txt").write_text("a text\n\nanother\n", encoding="utf-8")
    done = run_python(["tools/embed.py", "--checkpoint", str(model_dir), "--input", str(tmp_path / "bad.txt"),
                       "--output", str(tmp_path / "bad.npy")], timeout=300)
    assert done.returncode == 1 and f"{tmp_path / 'bad.txt'}:2: empty text" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "bad.npy").exists()
    # an existing output is refused, its bytes untouched
    before = (tmp_path / "emb-True.npy").read_bytes()
    done = run_python(["tools/embed.py", "--checkpoint", str(model_dir), "--input", str(texts),
                       "--output", str(tmp_path / "emb-True.npy")], timeout=300)
    assert done.returncode == 1 and "already exists" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "emb-True.npy").read_bytes() == before


def reference_window(st, rows, extra, range_min, range_max, margin):
    """Each row's whole candidate window under the rule below."""
    return reference_mining(st, rows, extra, 1, range_min, range_max, margin, whole_window=True)


def reference_mining(st, rows, extra, k, range_min, range_max, margin, whole_window=False):
    """The mining rule written out directly over sentence-transformers' own embeddings."""
    corpus = list(dict.fromkeys([p for _, p in rows] + extra))
    vectors = st.encode(corpus, normalize_embeddings=True, convert_to_numpy=True)
    out = []
    for anchor, positive in rows:
        a = st.encode([anchor], normalize_embeddings=True, convert_to_numpy=True)[0]
        scores = {text: float(vectors[i] @ a) for i, text in enumerate(corpus)}
        forbidden = {p for x, p in rows if x == anchor} | {anchor}
        ranked = sorted((t for t in corpus if t not in forbidden), key=lambda t: (-scores[t], corpus.index(t)))
        window = [t for t in ranked[range_min:range_max] if scores[t] <= scores[positive] - margin]
        out.append(window if whole_window else window[:k] if len(window) >= k else None)
    return out


def test_mined_negatives_equal_a_direct_computation_with_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    model_dir = export(tmp_path, "bert")
    words = ["the", "cat", "are", "in", "who", "hello", "world", "cafe", "naive", "w1", "w2", "w3", "w4"]  # no [UNK]
    anchors = [" ".join(words[i % 13:i % 13 + 3]) for i in range(12)]
    rows = [(a, f"{a} {words[(i * 5) % 13]} {i}") for i, a in enumerate(anchors)]  # positives share the anchor's words
    rows.append((rows[0][0], "cat in the cafe"))  # a second positive of the first anchor: never its negative
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"q": a, "p": p}) + "\n" for a, p in rows), encoding="utf-8")
    extra = [f"{w} {v} w9" for w in words[:6] for v in words[6:9]]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(extra) + "\n", encoding="utf-8")
    out = tmp_path / "mined.jsonl"
    args = ["tools/mine_negatives.py", "--checkpoint", str(model_dir), "--input", str(pairs), "--output", str(out),
            "--anchor-column", "q", "--positive-column", "p", "--corpus", str(corpus), "--num-negatives", "2",
            "--range-min", "0", "--range-max", "20", "--margin", "0.01"]
    done = run_python(args, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    want = reference_mining(st, rows, extra, 2, 0, 20, 0.01)
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    kept = [(row, negatives) for row, negatives in zip(rows, want) if negatives is not None]
    assert 3 <= len(kept) < len(rows), len(kept)  # some rows mined, some left out
    assert [(g["anchor"], g["positive"]) for g in got] == [row for row, _ in kept]
    assert [g["negatives"] for g in got] == [negatives for _, negatives in kept]
    assert f"for {len(kept)} of {len(rows)} rows" in done.stdout
    assert f"{len(rows) - len(kept)} rows left out" in done.stdout
    assert all(rows[0][1] not in g["negatives"] and "cat in the cafe" not in g["negatives"]
               for g in got if g["anchor"] == rows[0][0])
    # an existing output is refused, untouched
    before = out.read_bytes()
    done = run_python(args, timeout=300)
    assert done.returncode == 1 and "already exists" in done.stderr and out.read_bytes() == before
    # --sampling random: drawn from the whole window, seeded by (--seed, row): exactly the draws below
    sampled = tmp_path / "random.jsonl"
    done = run_python([*args[:6], str(sampled), *args[7:], "--sampling", "random", "--seed", "7"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    drawn = [json.loads(line) for line in sampled.read_text(encoding="utf-8").splitlines()]
    expected = []
    for i, window in enumerate(reference_window(st, rows, extra, 0, 20, 0.01)):
        if len(window) >= 2:
            expected.append([window[j] for j in sorted(np.random.default_rng([7, i]).choice(len(window), 2, replace=False))])
    assert [g["negatives"] for g in drawn] == expected
    assert expected != [g["negatives"] for g in got]  # not simply the top ones
