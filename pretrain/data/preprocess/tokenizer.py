"""BERT WordPiece tokenizers: reading and checking a Google-format vocab.txt, building the Hugging
Face ``tokenizers`` pipeline BERT uses, loading a tokenizer.json, and checking that lowercasing
agrees with the vocabulary.

The pipeline is Google BERT's: BertNormalizer (clean control characters, space out CJK
characters, lowercase and strip accents for uncased vocabularies), BertPreTokenizer (whitespace
and punctuation), WordPiece with ``##`` continuations and ``[UNK]`` for words it cannot cover
(max 100 characters per word), the WordPiece decoder, and a ``[CLS] A [SEP] (B [SEP])`` template.

Case consistency: a vocabulary built from lowercased text has no uppercase wordpieces, a cased one
has many. Tokenizing cased text with an uncased vocabulary turns every capitalised word into
``[UNK]``; lowercasing text for a cased vocabulary leaves its uppercase entries unused. Both are
clear errors (``check_case``); a small share of uppercase entries only warns.

Any other Hugging Face tokenizer.json loads too (a byte-level BPE as RoBERTa's or ModernBERT's, a
SentencePiece-style Unigram): its special tokens are read by role, never assumed, and where its
words start is read from its model and pre-tokenizer (special_tokens.py). The case check and
``--tokenizer-type`` concern WordPiece vocabularies only (a byte-level vocabulary spells a space
'Ġ', an uppercase letter to Python); another tokenizer's normalizer decides its case.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tokenizers import Tokenizer, decoders
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer
from tokenizers.processors import TemplateProcessing

from .special_tokens import (WORDPIECE_WORDS, SpecialTokens, TokenizerError, WordBoundaries,
                             tokenizer_json_special_tokens, word_boundaries, wordpiece_special_tokens)

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "BertTokenizerInfo",
    "TokenizerInfo",
    "SpecialTokens",
    "WordBoundaries",
    "read_special_tokens",
    "read_vocab",
    "check_special_tokens",
    "check_case",
    "bert_wordpiece_tokenizer",
    "tokenizer_vocab",
    "tokens_by_id",
    "vocabulary_tokens",
    "special_token_ids",
    "vocabulary_difference",
    "without_padding",
    "load_tokenizer",
    "tokenizer_model_type",
    "tokenizer_source",
    "vocabulary_description",
    "wordpiece_vocab",
    "write_vocab_file",
]

# The tokens BERT pretraining needs; Google's vocabularies put [PAD] at 0.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Megatron-LM's names for the two BERT tokenizers -> lowercase?
TOKENIZER_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
# Share of cased entries (among entries with letters that have case) above which a vocabulary
# counts as built from cased text.
_CASED_SHARE = 0.01


# --------------------------------------------------------------------------------------------
# vocab.txt
# --------------------------------------------------------------------------------------------


def read_vocab(path: str) -> dict[str, int]:
    """token -> id from a Google-format vocab.txt (one token per line, id = line number - 1)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TokenizerError(f"vocab file {path!r} does not exist") from None
    except OSError as e:
        raise TokenizerError(f"vocab file {path!r}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise TokenizerError(f"{path}:{line}: vocab file is not valid UTF-8") from None
    if text.endswith("\n"):
        text = text[:-1]
    vocab: dict[str, int] = {}
    for index, token in enumerate(text.split("\n") if text else []):
        token = token.rstrip("\r")
        if not token:
            raise TokenizerError(f"{path}:{index + 1}: empty line in vocab file (one token per line expected)")
        if token in vocab:
            raise TokenizerError(f"{path}:{index + 1}: token {token!r} repeats line {vocab[token] + 1}")
        vocab[token] = index
    check_special_tokens(vocab, path)
    return vocab


def check_special_tokens(vocab: Mapping[str, int], source: str) -> None:
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise TokenizerError(f"{source}: vocabulary lacks the special token{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)} (BERT needs {' '.join(SPECIAL_TOKENS)})")


def _case_counts(vocab: Mapping[str, int]) -> tuple[int, int, list[str]]:
    """(entries with an uppercase letter, entries with a letter that has case, a few examples)."""
    upper, cased, examples = 0, 0, []
    for token in vocab:
        if token.startswith("[") and token.endswith("]"):
            continue  # [PAD], [unused12], ...
        if token.lower() != token.upper():
            cased += 1
            if token != token.lower():
                upper += 1
                if len(examples) < 5:
                    examples.append(token)
    return upper, cased, examples


def check_case(vocab: Mapping[str, int], lowercase: bool, source: str, allow_mismatch: bool = False) -> list[str]:
    """Warnings about the vocabulary's case against ``lowercase``; raises TokenizerError on a
    clear mismatch unless ``allow_mismatch`` (then it is a warning too)."""
    upper, cased, examples = _case_counts(vocab)
    problem, warning = None, None
    if lowercase and upper > _CASED_SHARE * cased:
        problem = (f"{source} has {upper} wordpieces with uppercase letters (e.g. {', '.join(map(repr, examples))}): "
                   "it was built from cased text, but the tokenizer lowercases its input, so these entries can never be "
                   "produced; use a cased tokenizer (--tokenizer-type BertWordPieceCase / --cased) or an uncased vocabulary")
    elif lowercase and upper:
        warning = (f"{source} has {upper} wordpieces with uppercase letters (e.g. {', '.join(map(repr, examples))}) "
                   "that a lowercasing tokenizer never produces")
    elif not lowercase and cased and not upper:
        problem = (f"{source} has no wordpiece with an uppercase letter: it was built from lowercased text, but the "
                   "tokenizer keeps case, so capitalised words would become [UNK]; use a lowercasing tokenizer "
                   "(--tokenizer-type BertWordPieceLowerCase / --lowercase) or a cased vocabulary")
    elif not lowercase and upper < _CASED_SHARE * cased:
        warning = (f"{source} has only {upper} wordpieces with uppercase letters among {cased}: "
                   "is it really a cased vocabulary?")
    if problem and not allow_mismatch:
        raise TokenizerError(problem + " (--allow-case-mismatch proceeds anyway)")
    return [w for w in (problem, warning) if w]


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


def bert_wordpiece_tokenizer(vocab: Mapping[str, int], lowercase: bool) -> Tokenizer:
    """Google BERT's tokenizer over ``vocab`` (which must hold SPECIAL_TOKENS)."""
    tokenizer = Tokenizer(WordPiece(dict(vocab), unk_token="[UNK]", max_input_chars_per_word=100))
    # strip_accents=None follows lowercase, as in Google's BasicTokenizer and transformers
    tokenizer.normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                          lowercase=lowercase)
    tokenizer.pre_tokenizer = BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    # Registered as special so decode(skip_special_tokens=True) and transformers know them.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def tokenizer_vocab(tokenizer: Tokenizer) -> dict[str, int]:
    return tokenizer.get_vocab(with_added_tokens=True)


def tokens_by_id(vocab: Mapping[str, int]) -> tuple[str, ...]:
    """id -> token ("" for an id no token has, which a tokenizer.json may leave)."""
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tuple(tokens)


def vocabulary_tokens(path: str) -> tuple[str, ...]:
    """The tokens, in id order, of a vocab.txt or (by its .json suffix) a tokenizer.json."""
    if path.endswith(".json"):
        return tokens_by_id(tokenizer_vocab(load_tokenizer(tokenizer_json=path, allow_case_mismatch=True).tokenizer))
    return tokens_by_id(read_vocab(path))  # checks the special tokens


def vocabulary_description(path: str) -> tuple[tuple[str, ...], SpecialTokens, WordBoundaries]:
    """(tokens in id order, special tokens by role, word boundaries) of a vocab.txt or tokenizer.json."""
    info = load_tokenizer(**tokenizer_source(path), allow_case_mismatch=True)
    return tokens_by_id(tokenizer_vocab(info.tokenizer)), info.specials, info.words


def special_token_ids(tokens: Sequence[str]) -> list[int]:
    """Ids of the control tokens: the five BERT needs and any other bracketed one ([unused0], ...)."""
    return [i for i, t in enumerate(tokens) if t.startswith("[") and t.endswith("]")]


def vocabulary_difference(ours: Sequence[str], theirs: Sequence[str], here: str = "here",
                          there: str = "there") -> str:
    """How two different vocabularies differ, for a message: the first id that has another token
    (an equal-size vocabulary differs in no other way), else the sizes."""
    differ = [i for i in range(min(len(ours), len(theirs))) if ours[i] != theirs[i]]
    if not differ:
        return f"{len(ours)} tokens {here}, {len(theirs)} {there}"
    i = differ[0]
    return f"{len(differ)} of the ids have another token (e.g. id {i}: {ours[i]!r} {here}, {theirs[i]!r} {there})"


def without_padding(tokenizer: Tokenizer) -> list[str]:
    """Switch off the padding and truncation a tokenizer.json may carry (sentence-transformers
    ships Fixed 128 for both): text must be encoded as it is, every token kept and none added.
    Returns what was switched off ("padding to 128", "truncation at 128"), for a note."""
    removed = []
    if tokenizer.padding is not None:
        removed.append(f"padding to {tokenizer.padding.get('length') or 'the longest'}")
        tokenizer.no_padding()
    if tokenizer.truncation is not None:
        removed.append(f"truncation at {tokenizer.truncation.get('max_length')}")
        tokenizer.no_truncation()
    return removed


def _json_lowercase(config: dict) -> bool | None:
    """The lowercase flag of a tokenizer.json's normalizer (None if it has no normalizer)."""
    normalizer = config.get("normalizer")
    if not normalizer:
        return None
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return any(p.get("type") == "Lowercase" or (p.get("type") == "BertNormalizer" and p.get("lowercase"))
               for p in parts)


@dataclass
class BertTokenizerInfo:
    """A loaded tokenizer and what the data pipeline needs to know about it."""

    tokenizer: Tokenizer
    lowercase: bool
    vocab_size: int  # ids are < vocab_size (added tokens included)
    special_ids: dict[str, int]  # token text -> id of the roles ("[PAD]": 0, ...; "<mask>": 50264, ...)
    source: str  # the file it came from
    specials: SpecialTokens  # the special tokens by role: specials.mask_id, specials.token("mask"), ...
    words: WordBoundaries = WORDPIECE_WORDS  # where words start (whole-word masking)
    model_type: str = "WordPiece"  # the tokenizer's model: WordPiece, BPE, Unigram, ...
    warnings: list[str] = field(default_factory=list)
    switched_off: list[str] = field(default_factory=list)  # the tokenizer.json's own padding / truncation

    def to_str(self) -> str:
        return self.tokenizer.to_str()


TokenizerInfo = BertTokenizerInfo  # it is not only BERT's any more


def load_tokenizer(vocab_file: str | None = None, tokenizer_json: str | None = None,
                   tokenizer_type: str | None = None, allow_case_mismatch: bool = False) -> BertTokenizerInfo:
    """A tokenizer from exactly one of ``vocab_file`` (a BERT vocab.txt) or ``tokenizer_json``
    (any Hugging Face tokenizer.json: WordPiece, BPE, ...), with its special tokens by role.

    ``tokenizer_type`` (a TOKENIZER_TYPES name) sets lowercasing of a WordPiece vocabulary;
    without it, a vocab.txt gets the case its entries show and a tokenizer.json keeps its own
    normalizer. A tokenizer.json whose normalizer contradicts ``tokenizer_type``, or that is not
    WordPiece, is an error with it; its own padding and truncation are switched off
    (``without_padding``): every user of a loaded tokenizer wants the text's tokens as they are,
    or sets its own fixed length. A tokenizer without a pad, cls, sep or mask token is refused
    (special_tokens.py).
    """
    if (vocab_file is None) == (tokenizer_json is None):
        raise TokenizerError("give exactly one of a vocab file (vocab.txt) or a tokenizer.json")
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}")
    wanted = TOKENIZER_TYPES.get(tokenizer_type) if tokenizer_type else None
    notes: list[str] = []
    switched_off: list[str] = []
    if vocab_file is not None:
        source = vocab_file
        vocab = read_vocab(vocab_file)
        if wanted is None:
            upper, cased, _ = _case_counts(vocab)
            wanted = not upper > _CASED_SHARE * cased
            notes.append(f"{vocab_file}: no --tokenizer-type given; the vocabulary looks "
                         f"{'uncased, lowercasing' if wanted else 'cased, keeping case'} (BertWordPiece"
                         f"{'LowerCase' if wanted else 'Case'})")
        tokenizer = bert_wordpiece_tokenizer(vocab, wanted)
        model_type, words = "WordPiece", WORDPIECE_WORDS
        specials = wordpiece_special_tokens(vocab, vocab_file)
    else:
        source = tokenizer_json
        try:
            with open(tokenizer_json, encoding="utf-8") as f:
                config = json.load(f)
            tokenizer = Tokenizer.from_str(json.dumps(config))
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file {tokenizer_json!r} does not exist") from None
        except (OSError, ValueError, Exception) as e:  # tokenizers raises a bare Exception on bad content
            raise TokenizerError(f"{tokenizer_json}: not a Hugging Face tokenizer.json ({e})") from None
        model_type = (config.get("model") or {}).get("type") or "untyped"
        if tokenizer_type is not None and model_type != "WordPiece":
            raise TokenizerError(f"{tokenizer_json}: a {model_type} tokenizer; --tokenizer-type {tokenizer_type} names a "
                                 "BERT WordPiece one: leave it out (the tokenizer.json's normalizer decides the case)")
        has_lowercase = bool(_json_lowercase(config))
        if wanted is not None and wanted != has_lowercase:
            raise TokenizerError(f"{tokenizer_json}: its normalizer {'lowercases' if has_lowercase else 'keeps case'}, "
                                 f"but --tokenizer-type {tokenizer_type} asks for the opposite")
        wanted = has_lowercase
        switched_off = without_padding(tokenizer)
        vocab = tokenizer_vocab(tokenizer)
        try:
            specials = tokenizer_json_special_tokens(config, vocab, tokenizer_json)
        except TokenizerError:
            if model_type == "WordPiece":
                check_special_tokens(vocab, tokenizer_json)  # the message BERT users know, naming the missing [X]
            raise
        words = word_boundaries(config)
    if model_type == "WordPiece":
        notes += check_case(vocab, wanted, source, allow_case_mismatch)
    vocab = tokenizer_vocab(tokenizer)
    return BertTokenizerInfo(
        tokenizer=tokenizer,
        lowercase=wanted,
        vocab_size=max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1),
        special_ids=specials.by_token(),
        source=os.fspath(source),
        specials=specials,
        words=words,
        model_type=model_type,
        warnings=notes,
        switched_off=switched_off,
    )


def tokenizer_source(path: str) -> dict[str, str]:
    """load_tokenizer's keyword for a file: a tokenizer.json by its .json suffix, else a vocab.txt."""
    return {"tokenizer_json": path} if os.fspath(path).endswith(".json") else {"vocab_file": path}


def read_special_tokens(path: str) -> SpecialTokens:
    """The special tokens by role of a vocab.txt or tokenizer.json (by its .json suffix): what the
    model, fill-mask and fine-tuning sides call for pad/cls/sep/mask ids (``.pad_id``, ``.mask_id``,
    ``.token("mask")``, ...). Raises TokenizerError naming the file and a missing role."""
    return load_tokenizer(**tokenizer_source(path), allow_case_mismatch=True).specials


# --------------------------------------------------------------------------------------------
# vocab.txt from a tokenizer.json
# --------------------------------------------------------------------------------------------


def tokenizer_model_type(tokenizer_json: str) -> str | None:
    """The model of a Hugging Face tokenizer.json: "WordPiece", "BPE", "Unigram", ..."""
    try:
        with open(tokenizer_json, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {tokenizer_json!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{tokenizer_json}: not a Hugging Face tokenizer.json ({e})") from None
    model = config.get("model") if isinstance(config, dict) else None
    return model.get("type") if isinstance(model, dict) else None


def wordpiece_vocab(tokenizer_json: str) -> dict[str, int]:
    """token -> id of a WordPiece tokenizer.json (added tokens included), as the vocab.txt that
    expresses it holds them. Only WordPiece has a vocab.txt form: a BPE or Unigram tokenizer
    also needs its merges or scores, so other models are refused, naming the file."""
    model_type = tokenizer_model_type(tokenizer_json)
    if model_type != "WordPiece":
        raise TokenizerError(f"{tokenizer_json}: a {model_type or 'untyped'} tokenizer, not WordPiece: no vocab.txt "
                             "can express it (BERT checkpoints carry a WordPiece vocabulary)")
    vocab = tokenizer_vocab(load_tokenizer(tokenizer_json=tokenizer_json, allow_case_mismatch=True).tokenizer)
    # vocab.txt numbers tokens by line: an id no token has cannot be written
    unused = sorted(set(range(len(vocab))) - set(vocab.values()))
    if unused:
        raise TokenizerError(f"{tokenizer_json}: {len(vocab)} tokens with ids up to {max(vocab.values())} (no token "
                             f"has id {unused[0]}): a vocab.txt cannot number them")
    return vocab


def write_vocab_file(vocab: Mapping[str, int], path: str, source: str) -> None:
    """Write ``vocab`` (ids 0..n-1, as ``wordpiece_vocab`` returns) as a Google-format vocab.txt."""
    unwritable = [t for t in vocab if not t or "\n" in t or "\r" in t]  # a line holds one non-empty token
    if unwritable:
        raise TokenizerError(f"{source}: token {unwritable[0]!r} cannot be a line of a vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(f"{token}\n" for token, _ in sorted(vocab.items(), key=lambda item: item[1])))
