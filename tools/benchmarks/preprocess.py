"""Preprocessing benchmark: tools/preprocess_data.py against the Hugging Face tokenizer alone.

usage: python tools/benchmarks/preprocess.py [--corpus-dir DIR] [--target-mb 50] [--scale 10]
                                        [--vocab-file vocab.txt] [--workdir DIR] [--json out.json]
                                        [--formats-only] [--groups N]

Method
------
1. Corpus: every ``*.txt`` of --corpus-dir (default ../shared/data/austen next to the repository,
   when it exists) cut into paragraphs (blocks separated by blank lines), one JSON line
   ``{"text": paragraph}`` each, the whole replicated until it reaches --target-mb; a second file
   holds --scale copies of that one.
2. Vocabulary: --vocab-file, or one trained by tools/build_vocab.py (30522 entries asked; a small
   corpus supports fewer) on one copy of the paragraphs.
3. Measured one after the other, each in a fresh process:
   - ours: ``tools/preprocess_data.py --split-sentences`` with 1 and 2 workers, and with 2
     workers on the --scale x corpus; the same documents from Parquet files (rows of "text", row
     groups of 10,000; the parquet extra) with 2 workers, at 1x and --scale x. Parquet's MB/s
     counts the JSONL's bytes of the same text, so the two rates compare per MB of text. And the
     1x Parquet with a "source" column of --groups values drawn at random per row, preprocessed
     with --group-by source (one dataset per source: many groups in every chunk, the least
     favourable order). --formats-only runs these five only. MB/s is input bytes over the run's own processing time
     (its report's "elapsed": start-up, mostly importing torch for megatron-core, is reported
     apart). Peak RSS is the largest sum of the resident sets of the whole process tree, sampled
     from /proc every 0.1 s.
   - tokenizer alone: Hugging Face tokenizers ``encode_batch`` (batches of 1000 documents,
     add_special_tokens=False) over the same documents, already in memory, with 2 threads and
     with 1 (RAYON_NUM_THREADS); the same tokenizer as ours.
   - blingfire alone: ``blingfire.text_to_sentences`` over the same documents, one thread.
   - our worker's loop in one process (split + encode_batch_fast + packing), one thread: what
     one worker can do when it has a core to itself.
   "other load" is the CPU that other processes used meanwhile, in cores: anything well above
   0 means the figures are off (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "austen"


# ------------------------------------------------------------------------------------ corpus


def paragraphs(corpus_dir: Path) -> list[str]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"bench_preprocess: no *.txt files in {corpus_dir}")
    out: list[str] = []
    for path in files:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        out += [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return out


def write_corpus(paras: list[str], workdir: Path, target_mb: float, scale: int) -> tuple[Path, Path, Path, int]:
    """(one copy, base >= target_mb, scale x base, documents in base)."""
    block = "".join(json.dumps({"text": p}) + "\n" for p in paras).encode("utf-8")
    one = workdir / "one.jsonl"
    one.write_bytes(block)
    copies = max(1, -(-int(target_mb * 1e6) // len(block)))
    base = workdir / "base.jsonl"
    with open(base, "wb") as f:
        for _ in range(copies):
            f.write(block)
    big = workdir / f"x{scale}.jsonl"
    with open(big, "wb") as f:
        for _ in range(scale):
            with open(base, "rb") as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
    return one, base, big, copies * len(paras)


# ------------------------------------------------------------------------------------ measuring


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, stack, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        stack.extend(children.get(pid, []))
    return total


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run cmd; wall time, peak tree RSS, its output, and the CPU others used meanwhile."""
    import resource

    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, started = _busy_seconds(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    done.set()
    sampler.join()
    wall = time.perf_counter() - started
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after_children.ru_utime + after_children.ru_stime) - (before_children.ru_utime + before_children.ru_stime)
    if proc.returncode != 0:
        sys.stderr.write(stderr[-5000:])
        raise SystemExit(f"bench_preprocess: {' '.join(cmd[:3])} ... failed (exit {proc.returncode})")
    return dict(wall=wall, peak_rss=peak[0], stdout=stdout, other_load=max(0.0, (_busy_seconds() - busy - own) / wall))


def ours(corpus: Path, vocab: str, workers: int, workdir: Path, input_format: str = "jsonl",
         group_by: str | None = None) -> dict:
    prefix = workdir / f"out_w{workers}_{corpus.stem}_{input_format}{'_grouped' if group_by else ''}"
    result = run_measured([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", str(prefix), "--vocab-file", vocab, "--split-sentences",
                           "--workers", str(workers), "--input-format", input_format, "--quiet",
                           *(["--group-by", group_by] if group_by else [])])
    match = re.search(r"elapsed ([\d,.]+) s", result["stdout"])
    result["time"] = float(match.group(1).replace(",", ""))
    for path in prefix.parent.glob(f"{prefix.name}_*"):
        path.unlink()
    return result


def as_parquet(jsonl: Path, groups: int = 0) -> Path:
    """The JSONL's documents as a Parquet file of "text" rows, written 10,000 rows (one row group) at a
    time; with groups, a "source" column of that many values, each row's drawn at random (seeded):
    every chunk holds many groups, the least favourable order for --group-by."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = jsonl.with_name(f"{jsonl.stem}{f'_groups{groups}' if groups else ''}.parquet")
    fields = [("text", pa.string())] + ([("source", pa.string())] if groups else [])
    schema, draw = pa.schema(fields), random.Random(0)
    with open(jsonl, encoding="utf-8") as f, pq.ParquetWriter(str(out), schema) as writer:
        rows = []

        def flush():
            columns = {"text": rows} | ({"source": [f"s{draw.randrange(groups)}" for _ in rows]} if groups else {})
            writer.write_table(pa.table(columns, schema=schema))

        for line in f:
            rows.append(json.loads(line)["text"])
            if len(rows) == 10_000:
                flush()
                rows = []
        if rows:
            flush()
    return out


def child(kind: str, corpus: Path, vocab: str, threads: int, workdir: Path) -> dict:
    env = {"RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
    out = workdir / f"child_{kind}_{threads}.json"
    result = run_measured([sys.executable, str(Path(__file__).resolve()), "--child", kind, "--corpus", str(corpus),
                           "--vocab-file", vocab, "--child-out", str(out)], env=env)
    result["time"] = json.loads(out.read_text())["time"]
    return result


def child_main(args) -> None:
    """Runs in a fresh process: time one component over the documents, held in memory."""
    with open(args.corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    if args.child == "blingfire":
        import blingfire

        started = time.perf_counter()
        for doc in docs:
            blingfire.text_to_sentences(doc)
    elif args.child == "tokenizer":
        from pretrain.data.preprocess.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(vocab_file=args.vocab_file).tokenizer
        started = time.perf_counter()
        for i in range(0, len(docs), 1000):
            tokenizer.encode_batch(docs[i:i + 1000], add_special_tokens=False)
    elif args.child == "pipeline":
        from pretrain.data.preprocess.corpus import iter_chunks
        from pretrain.data.preprocess.encode import ChunkEncoder, EncodeOptions
        from pretrain.data.preprocess.tokenizer import load_tokenizer

        path = Path(args.child_out).with_suffix(".tokenizer.json")
        load_tokenizer(vocab_file=args.vocab_file).tokenizer.save(str(path))
        encoder = ChunkEncoder(EncodeOptions(str(path), "jsonl", ("text",), "uint16", split_sentences=True))
        chunks = list(iter_chunks([args.corpus], "jsonl"))
        started = time.perf_counter()
        for chunk in chunks:
            encoder(chunk)
    else:
        raise SystemExit(f"unknown child {args.child}")
    Path(args.child_out).write_text(json.dumps({"time": time.perf_counter() - started}))


# ------------------------------------------------------------------------------------ parent


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/benchmarks/preprocess.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.is_dir() else None,
                        help=f"directory of .txt files (default {DEFAULT_CORPUS} when it exists)")
    parser.add_argument("--target-mb", type=float, default=50.0, help="size of the base corpus (default 50 MB)")
    parser.add_argument("--scale", type=int, default=10, help="the large corpus is this many base corpora (default 10)")
    parser.add_argument("--vocab-file", help="vocab.txt to use (default: train one with tools/build_vocab.py)")
    parser.add_argument("--workdir", type=Path, help="where corpora and outputs go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--formats-only", action="store_true",
                        help="only the JSONL and Parquet runs of ours (2 workers, 1x and --scale x, and grouped)")
    parser.add_argument("--groups", type=int, default=100,
                        help="the grouped run: Parquet rows of this many sources, --group-by source (default 100)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def parent_main(args) -> None:
    if args.corpus_dir is None:
        raise SystemExit("bench_preprocess: give --corpus-dir (a directory of .txt files)")
    with tempfile.TemporaryDirectory(prefix="bench_preprocess-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        paras = paragraphs(args.corpus_dir)
        one, base, big, docs = write_corpus(paras, workdir, args.target_mb, args.scale)
        base_mb, big_mb = base.stat().st_size / 1e6, big.stat().st_size / 1e6
        print(f"corpus: {len(paras):,} paragraphs from {args.corpus_dir}, replicated to {base_mb:.1f} MB "
              f"({docs:,} documents) and {big_mb:.1f} MB ({args.scale}x)", flush=True)
        vocab = args.vocab_file
        if vocab is None:
            vocab = str(workdir / "vocab" / "vocab.txt")
            run_measured([sys.executable, str(REPO / "tools" / "build_vocab.py"), "--input", str(one),
                          "--output-dir", str(workdir / "vocab"), "--vocab-size", "30522"])
        with open(vocab, encoding="utf-8") as f:
            vocab_size = sum(1 for _ in f)
        print(f"vocabulary: {vocab} ({vocab_size:,} entries)", flush=True)

        rows = []

        def add(name: str, result: dict, mb: float, docs_n: int | None) -> dict:
            row = dict(name=name, mb=mb, time=result["time"], wall=result["wall"], mbps=mb / result["time"],
                       docs_per_s=docs_n / result["time"] if docs_n else None,
                       peak_rss_mb=result["peak_rss"] / 1e6, other_load=result["other_load"])
            rows.append(row)
            print(f"  {name}: {row['mbps']:.2f} MB/s, peak RSS {row['peak_rss_mb']:.0f} MB, "
                  f"other load {row['other_load']:.2f} cores", flush=True)
            return row

        ours2 = add("ours, --split-sentences, 2 workers", ours(base, vocab, 2, workdir), base_mb, docs)
        parquet2 = add("ours from Parquet, 2 workers", ours(as_parquet(base), vocab, 2, workdir, "parquet"),
                       base_mb, docs)
        big2 = add(f"ours, --split-sentences, 2 workers, {args.scale}x input", ours(big, vocab, 2, workdir),
                   big_mb, docs * args.scale)
        big_parquet = add(f"ours from Parquet, 2 workers, {args.scale}x input",
                          ours(as_parquet(big), vocab, 2, workdir, "parquet"), big_mb, docs * args.scale)
        grouped = add(f"ours from Parquet, --group-by over {args.groups} sources, 2 workers",
                      ours(as_parquet(base, args.groups), vocab, 2, workdir, "parquet", "source"), base_mb, docs)
        tok2 = None
        if not args.formats_only:
            add("ours, --split-sentences, 1 worker", ours(base, vocab, 1, workdir), base_mb, docs)
            tok2 = add("tokenizer alone (encode_batch), 2 threads", child("tokenizer", base, vocab, 2, workdir),
                       base_mb, docs)
            add("tokenizer alone (encode_batch), 1 thread", child("tokenizer", base, vocab, 1, workdir), base_mb, docs)
            add("blingfire alone, 1 thread", child("blingfire", base, vocab, 1, workdir), base_mb, docs)
            add("our worker loop in-process, 1 thread", child("pipeline", base, vocab, 1, workdir), base_mb, docs)

        print()
        print("| run | input MB | time s | MB/s | docs/s | peak RSS MB (tree) | MB/s vs tokenizer alone (2 threads) | other load |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            docs_s = f"{row['docs_per_s']:,.0f}" if row["docs_per_s"] else ""
            versus = f"{row['mbps'] / tok2['mbps']:.2f}" if tok2 else ""
            print(f"| {row['name']} | {row['mb']:,.1f} | {row['time']:,.1f} | {row['mbps']:.2f} | {docs_s} | "
                  f"{row['peak_rss_mb']:,.0f} | {versus} | {row['other_load']:.2f} |")
        ratio = big2["peak_rss_mb"] / ours2["peak_rss_mb"]
        startup = ours2["wall"] - ours2["time"]
        print()
        print(f"peak RSS at {args.scale}x the input / at 1x (2 workers): {ratio:.2f} (JSONL), "
              f"{big_parquet['peak_rss_mb'] / parquet2['peak_rss_mb']:.2f} (Parquet)")
        print(f"Parquet / JSONL per MB of text (2 workers): {parquet2['mbps'] / ours2['mbps']:.2f} at 1x, "
              f"{big_parquet['mbps'] / big2['mbps']:.2f} at {args.scale}x")
        print(f"--group-by over {args.groups} sources / ungrouped, Parquet (2 workers): "
              f"{grouped['mbps'] / parquet2['mbps']:.2f} per MB, peak RSS {grouped['peak_rss_mb']:,.0f} MB "
              f"against {parquet2['peak_rss_mb']:,.0f}")
        print(f"start-up outside the measured time (2 workers, mostly importing torch for megatron-core): {startup:.1f} s; "
              f"including it: {base_mb / ours2['wall']:.2f} MB/s")
        if any(row["other_load"] > 0.2 for row in rows):
            print("warning: other processes used the CPU during some runs (other load > 0.2 cores): figures are low")
        if args.json:
            args.json.write_text(json.dumps(dict(rows=rows, rss_ratio=ratio, vocab_size=vocab_size,
                                                 base_mb=base_mb, big_mb=big_mb), indent=2))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
