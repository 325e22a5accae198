"""Is the run's vocabulary the one its checkpoint was trained with? Checked before any rank
starts (torch-free: `python -m pretrain` and launcher.sh's --check-config both run it).

Every checkpoint keeps its tokenizer (tokenizer_files.save_vocab): a vocab.txt, and a
tokenizer.json when the run was given one. A run resuming it, or starting from it
(checkpoint.init_from), with another data.vocab_file of the same size would train on ids the weights
learnt for other tokens, and its next checkpoint would carry the new vocabulary as if the weights
had been trained on it.
"""
from __future__ import annotations

import os

from ..config import Config
from ..data.preprocess.tokenizer import vocabulary_difference
from ..data.samples.token_ids import VocabError, WordPieceVocab
from .filenames import LATEST, TOKENIZER_JSON, VOCAB_FILE
from .series import named_by_latest



def _tag_dir(path: str) -> str | None:
    """The checkpoint directory a save_dir's `latest` names, or `path` itself when it is one (a tag
    directory or a Hugging Face directory); None when there is nothing to load (yet)."""
    if os.path.isfile(os.path.join(path, LATEST)):
        tag = named_by_latest(path)  # None when unreadable or empty: the resume names that problem itself
        return os.path.join(path, tag) if tag else None
    return path if os.path.isdir(path) else None


def _checkpoint_vocab_file(directory: str) -> str | None:
    for name in (VOCAB_FILE, TOKENIZER_JSON):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def loaded_checkpoint(cfg: Config) -> tuple[str, str] | None:
    """(how the run uses it, directory) of the checkpoint whose weights the run will load: the
    latest in checkpoint.load_dir, else checkpoint.init_from's. None for a run from scratch."""
    t = cfg.checkpoint
    if t.load_dir and os.path.isfile(os.path.join(t.load_dir, LATEST)):
        directory = _tag_dir(t.load_dir)
        return ("resumes", directory) if directory else None
    if t.init_from:
        directory = _tag_dir(t.init_from)
        return ("starts from (checkpoint.init_from)", directory) if directory else None
    return None


def vocabulary_problems(cfg: Config) -> list[str]:
    """One line when data.vocab_file differs from the vocabulary of the checkpoint the run loads
    (unless checkpoint.accept_new_vocab); nothing when either has none to compare."""
    if not cfg.data.vocab_file or cfg.checkpoint.accept_new_vocab:
        return []
    found = loaded_checkpoint(cfg)
    theirs_path = _checkpoint_vocab_file(found[1]) if found else None
    if theirs_path is None:
        return []
    try:
        ours = WordPieceVocab.from_file(cfg.data.vocab_file).tokens
        theirs = WordPieceVocab.from_file(theirs_path).tokens
    except VocabError:
        return []  # an unreadable file is reported by the data checks, or by the load
    if ours == theirs:
        return []
    how = vocabulary_difference(ours, theirs)
    return [f"data.vocab_file {cfg.data.vocab_file} is not the vocabulary of the checkpoint this run {found[0]}, "
            f"{theirs_path}: {how}; use that vocabulary, or set checkpoint.accept_new_vocab=true to change it deliberately"]
