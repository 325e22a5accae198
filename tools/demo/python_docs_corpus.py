"""A real English corpus that every Python installation carries: its own documentation.

usage: python tools/demo/python_docs_corpus.py --output-dir DIR [--packages numpy,scipy,...] [--dev-fraction 0.1]
         [--seed 1234] [--train-pairs 10000] [--dev-pairs 2000] [--retrieval-queries 1000]

Sources, all on the machine once this project is installed (no download):
  - the Language Reference topics behind `help("if")` and friends (CPython's pydoc_data),
  - the docstrings of the standard library's modules, classes and functions,
  - the docstrings of installed packages (--packages; default the project's dependencies numpy,
    scipy, scikit-learn and matplotlib; one not installed is left out with a note).
Docstrings are read from the source with `ast`; nothing is imported.
Prose is kept; code samples, grammar productions, doctest lines and reST underlines are dropped.
Each topic or docstring is one document.

Writes
  DIR/corpus.jsonl           {"text": ...} per document of the train split: pretraining input
  DIR/coherence/train.tsv    a sentence-pair task in GLUE MRPC's layout: label 1 if sentence 2
  DIR/coherence/dev.tsv      is the sentence that follows sentence 1 in the documentation, 0 if
                             it comes from another document. Dev pairs come only from documents
                             held out of corpus.jsonl, so pretraining never saw them.
  DIR/retrieval/train.jsonl  a retrieval task (contrastive training, python -m finetune embed):
                             {"anchor": a document's first sentence (its summary line), "positive":
                             the sentences after it (at most PASSAGE_SENTENCES), "source": its
                             package}, for train documents of three sentences or more;
  DIR/retrieval/{queries.jsonl,corpus.jsonl,qrels.tsv}  the same from held-out documents in BEIR's
                             layout (at most --retrieval-queries queries, each relevant to its own
                             passage; every held-out passage in the corpus).
Identical documents (inherited docstrings) are kept once; documents are split between train and
dev by a hash of their text, so the split is stable.
Exit status: 0 done, 1 the output cannot be written, 2 bad usage.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

MIN_DOC_CHARS = 200
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
# Installed with this project (numpy, scipy, scikit-learn, matplotlib are its dependencies): their
# docstrings are several MB of English, enough text for a few minutes of pretraining.
DEFAULT_PACKAGES = "numpy,scipy,sklearn,matplotlib"
_CODE_LINE = re.compile(r"^(\s{3,}|\s*>>>|\s*\.\.\.|\s*\$ )|::=")
_UNDERLINE = re.compile(r"^\s*([*=\-~^#\"'+`])\1{2,}\s*$")


def prose(text: str) -> str:
    """Paragraphs of running text (one a line), without code, grammar or underlines."""
    paragraphs, current = [], []
    for line in text.splitlines():
        if not line.strip() or _CODE_LINE.search(line) or _UNDERLINE.match(line):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    if current:
        paragraphs.append(" ".join(current))
    # a "paragraph" of one or two words is a heading or a list fragment, not a sentence
    return "\n".join(p for p in paragraphs if len(p.split()) >= 4)


def reference_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {f"topic:{name}": text for name, text in sorted(topics.items())}


def docstrings(root: Path, prefix: str) -> dict[str, str]:
    """Docstrings of the modules, classes and functions of every .py file under root, by name."""
    docs = {}
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are templates or in other encodings; they are not prose
        module = prefix + path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs[f"doc:{module}.{getattr(node, 'name', '')}:{getattr(node, 'lineno', 0)}"] = doc
    return docs


def package_root(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def documents(packages: list[str]) -> tuple[dict[str, str], list[str]]:
    """(name -> prose for every source document with enough text, packages not installed)."""
    raw = {**reference_topics(), **docstrings(Path(sysconfig.get_paths()["stdlib"]), "")}
    missing = []
    for package in packages:
        root = package_root(package)
        if root is None:
            missing.append(package)
        else:
            raw.update(docstrings(root, f"{package}."))
    cleaned = {name: prose(text) for name, text in raw.items()}
    unique = {}  # an inherited or copied docstring appears many times: keep its first name only
    for name, text in cleaned.items():
        if len(text) >= MIN_DOC_CHARS:
            unique.setdefault(text, name)
    return {name: text for text, name in unique.items()}, missing


def is_dev(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def sentences(text: str) -> list[str]:
    from blingfire import text_to_sentences

    return [s for paragraph in text.splitlines() for s in text_to_sentences(paragraph).splitlines()
            if 4 <= len(s.split()) <= 60]


def coherence_pairs(docs: dict[str, str], rng: random.Random) -> list[tuple[int, str, str]]:
    """(label, sentence 1, sentence 2): half followers, half sentences of another document."""
    split = {name: sentences(text) for name, text in docs.items()}
    names = [name for name, sents in split.items() if len(sents) >= 2]
    pairs = []
    for name in names:
        sents = split[name]
        for first, follower in zip(sents, sents[1:]):
            if rng.random() < 0.5:
                pairs.append((1, first, follower))
            else:
                other = rng.choice(names)
                while other == name and len(names) > 1:
                    other = rng.choice(names)
                pairs.append((0, first, rng.choice(split[other])))
    rng.shuffle(pairs)
    return pairs


PASSAGE_SENTENCES = 5


def retrieval_rows(docs: dict[str, str]) -> list[dict[str, str]]:
    """A summary line and the passage after it for each document of three sentences or more,
    with the package it documents ("reference" for the language reference)."""
    rows = []
    for name, text in docs.items():
        sents = sentences(text)
        if len(sents) >= 3:
            source = "reference" if name.startswith("topic:") else name.split(":")[1].split(".")[0]
            rows.append({"anchor": sents[0], "positive": " ".join(sents[1:1 + PASSAGE_SENTENCES]), "source": source})
    return rows


def write_retrieval(out: Path, train_rows: list[dict], dev_rows: list[dict], queries: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in train_rows)
    with open(out / "queries.jsonl", "w", encoding="utf-8") as q, open(out / "qrels.tsv", "w", encoding="utf-8") as r:
        r.write("query-id\tcorpus-id\tscore\n")
        for i, row in enumerate(dev_rows[:queries]):
            q.write(json.dumps({"_id": f"q{i}", "text": row["anchor"]}) + "\n")
            r.write(f"q{i}\td{i}\t1\n")
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"_id": f"d{i}", "text": row["positive"]}) + "\n" for i, row in enumerate(dev_rows))


def write_mrpc(path: Path, pairs) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
        for i, (label, a, b) in enumerate(pairs):
            f.write(f"{label}\t{2 * i}\t{2 * i + 1}\t{_tsv(a)}\t{_tsv(b)}\n")


def _tsv(text: str) -> str:
    return text.replace("\t", " ").replace("\n", " ")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/demo/python_docs_corpus.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dev-fraction", type=float, default=0.1, help="share of documents held out (default 0.1)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the pair sampling")
    parser.add_argument("--train-pairs", type=int, default=10000, help="at most this many train pairs (0: all)")
    parser.add_argument("--dev-pairs", type=int, default=2000, help="at most this many dev pairs (0: all)")
    parser.add_argument("--retrieval-queries", type=int, default=1000,
                        help="at most this many held-out retrieval queries (default 1000)")
    parser.add_argument("--packages", default=DEFAULT_PACKAGES,
                        help=f"installed packages whose docstrings join the corpus, comma-separated ('' for none; "
                             f"default {DEFAULT_PACKAGES})")
    args = parser.parse_args(argv)
    args.packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    if args.train_pairs < 0 or args.dev_pairs < 0:
        parser.error("--train-pairs and --dev-pairs must be >= 0")
    if not 0 < args.dev_fraction < 1:
        parser.error(f"--dev-fraction must be between 0 and 1, got {args.dev_fraction}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir)
    docs, missing = documents(args.packages)
    if missing:
        print(f"python_docs_corpus: note: not installed, left out: {', '.join(missing)}", file=sys.stderr)
    train = {n: t for n, t in docs.items() if not is_dev(t, args.dev_fraction)}
    dev = {n: t for n, t in docs.items() if is_dev(t, args.dev_fraction)}
    rng = random.Random(args.seed)
    try:
        (out / "coherence").mkdir(parents=True, exist_ok=True)
        tmp = out / "corpus.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for name, text in train.items():
                f.write(json.dumps({"text": text, "source": name}) + "\n")
        tmp.replace(out / "corpus.jsonl")
        train_pairs = coherence_pairs(train, rng)[:args.train_pairs or None]
        dev_pairs = coherence_pairs(dev, rng)[:args.dev_pairs or None]
        write_mrpc(out / "coherence" / "train.tsv", train_pairs)
        write_mrpc(out / "coherence" / "dev.tsv", dev_pairs)
        train_rows, dev_rows = retrieval_rows(train), retrieval_rows(dev)
        write_retrieval(out / "retrieval", train_rows, dev_rows, args.retrieval_queries)
    except OSError as e:
        print(f"python_docs_corpus: error: cannot write {out}: {e}", file=sys.stderr)
        return 1
    size = sum(len(t.encode()) for t in train.values())
    print(f"wrote {len(train)} documents ({size / 1e6:.1f} MB of prose; {len(dev)} more held out) to "
          f"{out / 'corpus.jsonl'}; coherence pairs: {len(train_pairs)} train, {len(dev_pairs)} dev in {out / 'coherence'}; "
          f"retrieval: {len(train_rows)} train pairs, {min(len(dev_rows), args.retrieval_queries)} queries over "
          f"{len(dev_rows)} passages in {out / 'retrieval'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
