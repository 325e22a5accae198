"""A made-up English-like corpus with structure a tiny BERT learns in a few hundred steps.

Each document follows one character; every sentence names the character, and a character's
verbs and objects come from small per-character sets. A masked word is therefore predictable
from its context (far better than the most frequent word), and a true next sentence shares
its character with the previous one (NSP is learnable too).
"""
from __future__ import annotations

import json

import numpy as np

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar"]
VERBS = ["reads", "paints", "finds", "sells", "builds", "cleans", "carries", "draws", "opens", "keeps", "loses",
         "fixes", "throws", "catches", "washes", "hides"]
ADJECTIVES = ["red", "small", "old", "bright", "heavy", "quiet", "strange", "wooden", "silver", "broken"]
NOUNS = ["book", "boat", "lamp", "chair", "letter", "basket", "garden", "window", "clock", "bridge", "candle",
         "wagon", "mirror", "ladder", "kettle", "blanket"]
PLACES = ["in the morning", "at the market", "near the river", "after dinner", "before the storm", "in the hall"]


def _sentence(rng: np.random.Generator, who: int) -> str:
    verb = (who * 3 + int(rng.integers(2))) % len(VERBS)
    noun = (who * 5 + int(rng.integers(3))) % len(NOUNS)
    adjective = ADJECTIVES[(noun + int(rng.integers(2))) % len(ADJECTIVES)]  # nouns have their adjectives
    place = PLACES[verb % len(PLACES)]  # and verbs their places
    return f"{NAMES[who].capitalize()} {VERBS[verb]} the {adjective} {NOUNS[noun]} {place}."


def documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(_sentence(rng, int(who)) for _ in range(int(rng.integers(3, 9))))
            for who in rng.integers(len(NAMES), size=count)]


def write_jsonl(path, count: int, seed: int = 0) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in documents(count, seed):
            f.write(json.dumps({"text": text}) + "\n")
