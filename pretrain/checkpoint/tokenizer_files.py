"""The tokenizer files a checkpoint carries beside its weights (vocab.txt, tokenizer.json and
the files transformers adds), copied as they are and checked against the model's vocabulary.

A WordPiece tokenizer.json travels with the vocab.txt it implies (transformers' slow
BertTokenizer and older readers take it). Any other tokenizer.json (a byte-level BPE as
RoBERTa's or ModernBERT's) has no vocab.txt form: it travels alone, with the
tokenizer_config.json and special_tokens_map.json beside it when there are, since they may name
its special tokens (pretrain/data/preprocess/special_tokens.py)."""
from __future__ import annotations

import os
import shutil

from ..data.preprocess.special_tokens import SIBLING_CONFIGS
from ..data.preprocess.tokenizer import (BertTokenizerInfo, TokenizerError, load_tokenizer, read_vocab, tokenizer_model_type,
                              tokenizer_source, tokenizer_vocab, wordpiece_vocab, write_vocab_file)
from .format import TOKENIZER_FILES, TOKENIZER_JSON, VOCAB_FILE, CheckpointError


def checkpoint_tokenizer(vocab_dir: str | None, vocab_size: int, source: str, vocab_file: str | None = None,
                         how_to_name_one: str = "pass --vocab-file") -> BertTokenizerInfo:
    """The tokenizer `vocab_file` names (a vocab.txt or a tokenizer.json), else the checkpoint's
    own (its tokenizer.json, else its vocab.txt): what fine-tuning, feature extraction and
    fill-mask all use. It must fit the model's `vocab_size`. Raises CheckpointError; the message
    for a checkpoint without a tokenizer ends with `how_to_name_one`."""
    if vocab_file:
        path = vocab_file
    elif vocab_dir:
        path = os.path.join(vocab_dir, TOKENIZER_JSON)
        if not os.path.exists(path):
            path = os.path.join(vocab_dir, VOCAB_FILE)
    else:
        raise CheckpointError(f"{source} carries no vocabulary: {how_to_name_one}")
    try:
        info = load_tokenizer(**tokenizer_source(path))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if info.vocab_size > vocab_size:
        raise CheckpointError(f"the tokenizer ({path}) has {info.vocab_size} tokens, the checkpoint's vocabulary "
                              f"{vocab_size}: they do not belong together")
    return info


def save_vocab(vocab_file: str, tag_dir: str) -> None:
    """Keep the tokenizer with the weights (conversion to Hugging Face format needs it): a
    vocab.txt as is; a WordPiece tokenizer.json as is plus the vocab.txt it implies; another
    tokenizer.json (BPE, ...) as is, with the tokenizer_config.json and special_tokens_map.json
    beside it (they may name its special tokens), and no vocab.txt."""
    if not vocab_file.endswith(".json"):
        shutil.copyfile(vocab_file, os.path.join(tag_dir, VOCAB_FILE))
        return
    info = load_tokenizer(tokenizer_json=vocab_file)
    shutil.copyfile(vocab_file, os.path.join(tag_dir, TOKENIZER_JSON))
    # written into the unpublished tag directory: no temp-then-rename needed
    if info.model_type == "WordPiece":
        write_vocab_file(tokenizer_vocab(info.tokenizer), os.path.join(tag_dir, VOCAB_FILE), vocab_file)
        return
    for name in SIBLING_CONFIGS:
        sibling = os.path.join(os.path.dirname(os.path.abspath(vocab_file)), name)
        if os.path.isfile(sibling):
            shutil.copyfile(sibling, os.path.join(tag_dir, name))


def has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in (VOCAB_FILE, TOKENIZER_JSON))


def tokenizer_vocabulary(directory: str) -> dict[str, int]:
    """token -> id of the tokenizer in `directory`: its tokenizer.json's (what transformers'
    AutoTokenizer reads), which a vocab.txt beside a WordPiece one must agree with; else its
    vocab.txt's. A tokenizer.json of another model (BPE, ...) stands alone (a vocab.txt beside it,
    which older checkpoints carried, is not read); one without a pad, cls, sep or mask token is
    refused, naming the file and the role."""
    listed, tokenizer_json = os.path.join(directory, VOCAB_FILE), os.path.join(directory, TOKENIZER_JSON)
    try:
        if not os.path.exists(tokenizer_json):
            return read_vocab(listed)
        if tokenizer_model_type(tokenizer_json) != "WordPiece":
            return tokenizer_vocab(load_tokenizer(tokenizer_json=tokenizer_json).tokenizer)
        vocab = wordpiece_vocab(tokenizer_json)
        if os.path.exists(listed):
            _check_same_vocabulary(read_vocab(listed), vocab, listed, tokenizer_json)
        return vocab
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None


def _check_same_vocabulary(listed: dict[str, int], vocab: dict[str, int], listed_path: str,
                           tokenizer_json: str) -> None:
    """vocab.txt's tokens must have its ids in tokenizer.json, which may add tokens after them
    (transformers 4 kept added tokens out of vocab.txt)."""
    differ = [token for token, i in listed.items() if vocab.get(token) != i]
    if differ:
        token = differ[0]
        raise CheckpointError(f"{listed_path} and {tokenizer_json} disagree on {len(differ)} token(s), e.g. {token!r}: "
                              f"id {listed[token]} in {VOCAB_FILE}, {vocab.get(token)} in {TOKENIZER_JSON}")


def check_vocab_fits(vocab: dict[str, int], vocab_size: int, source: str) -> None:
    if len(vocab) > vocab_size:
        raise CheckpointError(f"{source}: the tokenizer has {len(vocab)} tokens but the model's vocab_size is {vocab_size}")


def copy_vocab_files(src_dir: str, dst_dir: str) -> dict[str, int]:
    """Copy every tokenizer file of src_dir as it is, and write the vocab.txt a WordPiece
    tokenizer.json implies where there is none (transformers' slow BertTokenizer and older
    readers take vocab.txt); another tokenizer.json (BPE, ...) has no vocab.txt form and gets
    none. Returns the vocabulary."""
    vocab = tokenizer_vocabulary(src_dir)
    if os.path.abspath(src_dir) != os.path.abspath(dst_dir):
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(src_dir, name)):
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    tokenizer_json = os.path.join(src_dir, TOKENIZER_JSON)
    wordpiece = not os.path.exists(tokenizer_json) or tokenizer_model_type(tokenizer_json) == "WordPiece"
    if wordpiece and not os.path.exists(os.path.join(dst_dir, VOCAB_FILE)):
        try:
            write_vocab_file(vocab, os.path.join(dst_dir, VOCAB_FILE), os.path.join(src_dir, TOKENIZER_JSON))
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
    return vocab
