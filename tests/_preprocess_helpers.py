"""Small corpora and fault-injecting encoders for the preprocessing tests.

The encoders live here (not in a test file) because worker processes are spawned: they import
the encoder class by module name, and this module imports nothing heavy.
"""
from __future__ import annotations

import json
import os
import random

from pretrain.data.preprocess.encode import ChunkEncoder

WORDS = ("the a of and to in was she he it her his that had for with as but not be on at by which "
         "Emma Harriet Knightley Elton Weston Highbury Hartfield Donwell London Mr Mrs Miss "
         "café naïve rôle façade Zürich Ångström résumé 東京 北京 "
         "extraordinarily unquestionably incomprehensibility antidisestablishmentarianism "
         "1816 42 3.14 £5 20% can't won't o'clock well-known e-mail").split()
PUNCT = (".", ".", ".", "!", "?", ";", ",")


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 14))]
    words[0] = words[0][:1].upper() + words[0][1:]
    if rng.random() < 0.2:
        words.insert(rng.randint(1, len(words)), rng.choice([",", "—", "(aside)", "\"quoted\""]))
    return " ".join(words) + rng.choice(PUNCT)


def documents(n: int, seed: int = 0, empty_every: int = 0) -> list[str]:
    """n documents of 1-6 sentences; every empty_every-th one is whitespace only."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            docs.append("   ")
            continue
        docs.append(" ".join(sentence(rng) for _ in range(rng.randint(1, 6))))
    return docs


def write_jsonl(path: str, docs: list[str], key: str = "text", extra: dict | None = None) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            record = {"id": i, key: doc, **(extra or {})}
            f.write(json.dumps(record, ensure_ascii=bool(i % 2)) + "\n")
    return path


def hard_wrap(text: str, width: int = 40) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "\n".join(lines)


class RaisingEncoder(ChunkEncoder):
    """Raises on the chunk with index 2 of any file."""

    def __call__(self, chunk):
        if chunk.index == 2:
            raise RuntimeError("injected failure")
        return super().__call__(chunk)


class DyingEncoder(ChunkEncoder):
    """The worker process dies (as if killed by the OOM killer) on chunk 2."""

    def __call__(self, chunk):
        if chunk.index == 2:
            os._exit(9)
        return super().__call__(chunk)


class DyingAtStartEncoder(ChunkEncoder):
    """The worker process dies while starting (in the pool's initializer)."""

    def __init__(self, options):
        os._exit(3)


def small_vocab(directory) -> str:
    """A 200-entry WordPiece vocab.txt (and tokenizer.json) learnt from documents(400) in `directory`."""
    from pretrain.data.preprocess.vocab_builder import VocabOptions, build_vocab

    corpus = write_jsonl(os.path.join(directory, "c.jsonl"), documents(400, seed=1))
    build_vocab([corpus], "jsonl", ["text"], VocabOptions(vocab_size=200), os.path.join(directory, "vocab.txt"),
                os.path.join(directory, "tokenizer.json"))
    return os.path.join(directory, "vocab.txt")
