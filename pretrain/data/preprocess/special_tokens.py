"""Special tokens by role, and where words start: what pretraining, fill-mask and fine-tuning need
to know about a tokenizer beyond its ids, read from the tokenizer itself, never assumed.

Roles: ``pad``, ``unk``, ``cls``, ``sep``, ``mask``. Every one but ``unk`` is required (a
byte-level BPE never produces an unknown token and may have none); a tokenizer without one is
refused, naming the file and the role.

- A Google vocab.txt (WordPiece): the BERT names [PAD] [UNK] [CLS] [SEP] [MASK]; every other
  bracketed entry ([unused0], ...) is a control token too.
- A Hugging Face tokenizer.json, each role from the first of:
  1. ``<role>_token`` of a ``tokenizer_config.json`` beside it, else of a ``special_tokens_map.json``
     (transformers' own settings: a string, or an AddedToken dict with its ``content``);
  2. cls and sep: its post-processor (TemplateProcessing: the special token before ``$A`` and the
     one after it in the single-sequence template; RobertaProcessing and BertProcessing: their
     ``cls``/``sep``; inside a Sequence processor too); pad: its own ``padding.pad_token``;
     unk: its model's ``unk_token``;
  3. a known spelling among the tokens it registers as special (``added_tokens`` with
     ``special``: ``[MASK]`` or ``<mask>``, ``[CLS]`` or ``<s>``, ...; a WordPiece vocabulary's own
     entries count too). Learnt BPE pieces never count: a corpus of HTML may merge ``<s>``.
  The ids are the tokenizer's (RoBERTa: <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=50264; ModernBERT:
  [UNK]=50280 [CLS]=50281 [SEP]=50282 [PAD]=50283 [MASK]=50284). A template whose id for cls or
  sep is not the vocabulary's, a role naming a token the vocabulary lacks, or a mask token that
  is also the pad, cls or sep token is refused. The control tokens (never predicted, never drawn
  as a random replacement, counted as special in datasets) are the roles and every added token
  marked special, plus bracketed entries of a WordPiece vocabulary.

Word starts, for whole-word masking (``WordBoundaries``), from the model and pre-tokenizer:

- WordPiece (or a BPE with a ``continuing_subword_prefix``): a token continues the word before it
  when it starts with the prefix (``##``);
- a ByteLevel pre-tokenizer (RoBERTa, GPT-2, ModernBERT): a token starts a word when its first
  character is a byte-level whitespace (``Ġ`` for a space, ``Ċ`` for a line break, ...); any
  other token continues the word before it. Punctuation written against a word without a
  space (``world.``) is masked with it: the words are the text's whitespace-separated words;
- a Metaspace pre-tokenizer (SentencePiece-style, ``▁``): likewise with its replacement character;
- anything else (no marker to read words from): every token is a word of its own, so whole-word
  masking masks single tokens.

A special token never continues a word. The edge case of the marker rules: the first word of a
sentence has no space before it, so without a ``add_prefix_space`` (ModernBERT's ByteLevel has
none) its first token carries no marker and would read as the continuation of the previous
sentence's last token. The sample builder therefore starts a word at every sentence start
(pretrain/data/samples/bert_dataset.py), and the masking starts one after every token that is no
candidate ([CLS], [SEP], ...), so a segment's first word is a word of its own.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ...common.errors import UserError

__all__ = [
    "ROLES",
    "REQUIRED_ROLES",
    "KNOWN_SPELLINGS",
    "TokenizerError",
    "SpecialTokensError",
    "SpecialTokens",
    "WordBoundaries",
    "BYTE_LEVEL_WHITESPACE",
    "WORDPIECE_WORDS",
    "wordpiece_special_tokens",
    "tokenizer_json_special_tokens",
    "word_boundaries",
    "is_bracketed",
]

ROLES = ("pad", "unk", "cls", "sep", "mask")
REQUIRED_ROLES = ("pad", "cls", "sep", "mask")
# Spellings tried (in this order) among a tokenizer's own special tokens when nothing names the role.
KNOWN_SPELLINGS = {
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
}
# The BERT names a Google vocab.txt must hold
BERT_NAMES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
# GPT-2's bytes_to_unicode maps the bytes 0-32 to U+0100-U+0120: the whitespace bytes \t \n \v \f \r
# and the space become these characters in a byte-level vocabulary (the space is 'Ġ').
BYTE_LEVEL_WHITESPACE = frozenset(chr(256 + b) for b in (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20))
SIBLING_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


class TokenizerError(UserError, ValueError):
    """A vocabulary or tokenizer that cannot be used, naming the file and the problem
    (tokenizer.py's readers raise it too)."""


class SpecialTokensError(TokenizerError):
    """A tokenizer whose special tokens cannot be told, naming the file and the role."""


def is_bracketed(token: str) -> bool:
    return len(token) >= 2 and token.startswith("[") and token.endswith("]")  # tokenizer.special_token_ids' rule


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens of one tokenizer by role, with their ids in it.

    The API for everyone who needs an id: ``pad_id``, ``unk_id`` (None when the tokenizer has no
    unknown token), ``cls_id``, ``sep_id``, ``mask_id``; ``token(role)`` for the text of one (to
    find ``<mask>`` in a fill-mask sentence); ``control_ids`` for every id never predicted nor drawn."""

    source: str  # the file the roles were read from
    tokens: Mapping[str, str]  # role -> token text (no "unk" key when there is none)
    ids: Mapping[str, int]  # role -> id
    control_ids: tuple[int, ...] = ()  # sorted: the roles' ids and every other control token's
    found_by: Mapping[str, str] = field(default_factory=dict)  # role -> where it was read (for messages)

    @property
    def pad_id(self) -> int:
        return self.ids["pad"]

    @property
    def unk_id(self) -> int | None:
        return self.ids.get("unk")

    @property
    def cls_id(self) -> int:
        return self.ids["cls"]

    @property
    def sep_id(self) -> int:
        return self.ids["sep"]

    @property
    def mask_id(self) -> int:
        return self.ids["mask"]

    def token(self, role: str) -> str:
        if role not in ROLES:
            raise KeyError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        if role not in self.tokens:
            raise SpecialTokensError(f"{self.source}: the tokenizer has no {role} token")
        return self.tokens[role]

    def by_token(self) -> dict[str, int]:
        """token text -> id of the roles (the shape of the older ``special_ids`` dict)."""
        return {self.tokens[role]: self.ids[role] for role in ROLES if role in self.tokens}

    def describe(self) -> str:
        return ", ".join(f"{role} {self.tokens[role]}={self.ids[role]}" for role in ROLES if role in self.tokens)


@dataclass(frozen=True)
class WordBoundaries:
    """How to tell from a token alone whether it starts a word (module docstring).

    kind: "prefix" (a token starting with ``marker`` continues a word: WordPiece ``##``),
    "marker" (a token starts a word when it starts with one of ``markers``: ByteLevel's whitespace
    characters, Metaspace's ``▁``), or "none" (every token is a word)."""

    kind: str
    markers: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "prefix":
            return f"a token starting with {self.markers[0]!r} continues a word"
        if self.kind == "marker":
            shown = "'Ġ' (a space) or another byte-level whitespace" if "Ġ" in self.markers else repr(self.markers[0])
            return f"a token starts a word when it starts with {shown}"
        return "no word boundaries to read: every token is a word of its own"

    def continuation_flags(self, tokens: Sequence[str], control_ids: Sequence[int]) -> np.ndarray:
        """bool per id: the token continues the word before it. Control tokens and ids without a
        token never do."""
        if self.kind == "prefix":
            prefix = self.markers[0]
            flags = np.fromiter((t.startswith(prefix) for t in tokens), dtype=bool, count=len(tokens))
        elif self.kind == "marker":
            starts = tuple(self.markers)
            flags = np.fromiter((bool(t) and not t.startswith(starts) for t in tokens), dtype=bool, count=len(tokens))
        else:
            flags = np.zeros(len(tokens), dtype=bool)
        flags[np.asarray(list(control_ids), dtype=np.int64)] = False
        return flags


WORDPIECE_WORDS = WordBoundaries("prefix", ("##",))


# --------------------------------------------------------------------------------------------
# vocab.txt
# --------------------------------------------------------------------------------------------


def wordpiece_special_tokens(vocab: Mapping[str, int], source: str) -> SpecialTokens:
    """The BERT names of a Google vocab.txt (tokenizer.check_special_tokens checked they are there)."""
    missing = [name for name in BERT_NAMES.values() if name not in vocab]
    if missing:
        raise SpecialTokensError(f"{source}: vocabulary lacks the special token{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(missing)}")
    controls = sorted({i for t, i in vocab.items() if is_bracketed(t)})
    return SpecialTokens(source, dict(BERT_NAMES), {role: vocab[name] for role, name in BERT_NAMES.items()},
                         tuple(controls), {role: "the BERT name" for role in ROLES})


# --------------------------------------------------------------------------------------------
# tokenizer.json
# --------------------------------------------------------------------------------------------


def _content(value: Any) -> str | None:
    """A transformers special-token setting: "<mask>", or {"content": "<mask>", ...}, or null."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _sibling_settings(tokenizer_json: str) -> tuple[dict[str, str], dict[str, str]]:
    """(role -> token, role -> file) from tokenizer_config.json, then special_tokens_map.json,
    beside the tokenizer.json. An unreadable one is an error naming it."""
    tokens, where = {}, {}
    directory = os.path.dirname(os.path.abspath(tokenizer_json))
    for name in SIBLING_CONFIGS:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                settings = json.load(f)
        except (OSError, ValueError) as e:
            raise SpecialTokensError(f"{path}: unreadable ({e}); it names {tokenizer_json}'s special tokens") from None
        if not isinstance(settings, dict):
            raise SpecialTokensError(f"{path}: not a JSON object; it names {tokenizer_json}'s special tokens")
        for role in ROLES:
            token = _content(settings.get(f"{role}_token"))
            if token is not None and role not in tokens:
                tokens[role], where[role] = token, f"{name}'s {role}_token"
    return tokens, where


def _processors(config: Mapping) -> list[dict]:
    post = config.get("post_processor")
    if not isinstance(post, dict):
        return []
    if post.get("type") == "Sequence":
        return [p for p in post.get("processors", []) if isinstance(p, dict)]
    return [post]


def _template_roles(config: Mapping, source: str) -> tuple[dict[str, str], dict[str, int]]:
    """(role -> token, role -> id in the template) for cls and sep from the post-processor."""
    for post in _processors(config):
        kind = post.get("type")
        if kind in ("RobertaProcessing", "BertProcessing"):
            tokens, ids = {}, {}
            for role in ("cls", "sep"):
                pair = post.get(role)
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    tokens[role], ids[role] = str(pair[0]), int(pair[1])
            return tokens, ids
        if kind == "TemplateProcessing":
            single = post.get("single") or []
            names = [(item.get("SpecialToken") or {}).get("id") if "SpecialToken" in item else None
                     for item in single if isinstance(item, dict)]
            kinds = ["special" if "SpecialToken" in item else "sequence" for item in single if isinstance(item, dict)]
            tokens = {}
            if "sequence" in kinds:
                a = kinds.index("sequence")
                if a > 0 and kinds[a - 1] == "special":
                    tokens["cls"] = names[a - 1]
                if a + 1 < len(kinds) and kinds[a + 1] == "special":
                    tokens["sep"] = names[a + 1]
            specials = post.get("special_tokens") or {}
            ids = {}
            for role, name in tokens.items():
                entry = specials.get(name) or {}
                entry_ids = entry.get("ids") or []
                if len(entry_ids) != 1:
                    raise SpecialTokensError(f"{source}: the post-processor's template token {name!r} ({role}) has "
                                             f"{len(entry_ids)} ids; one expected")
                ids[role] = int(entry_ids[0])
            return tokens, ids
    return {}, {}


def tokenizer_json_special_tokens(config: Mapping, vocab: Mapping[str, int], source: str) -> SpecialTokens:
    """The roles of a tokenizer.json (parsed as ``config``, whose token -> id with added tokens is
    ``vocab``), read as the module docstring says; ``source`` is its path (siblings are read
    beside it)."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    added = [t for t in config.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("content"), str)]
    special_added = {t["content"]: int(t["id"]) for t in added if t.get("special")}
    wordpiece = model.get("type") == "WordPiece"

    tokens, where = _sibling_settings(source)
    template_tokens, template_ids = _template_roles(config, source)
    for role, token in template_tokens.items():
        if role not in tokens:
            tokens[role], where[role] = token, "the post-processor's template"
    padding = config.get("padding")
    if "pad" not in tokens and isinstance(padding, dict) and isinstance(padding.get("pad_token"), str):
        tokens["pad"], where["pad"] = padding["pad_token"], "its padding's pad_token"
    if "unk" not in tokens and isinstance(model.get("unk_token"), str):
        tokens["unk"], where["unk"] = model["unk_token"], "its model's unk_token"
    for role in ROLES:
        if role in tokens:
            continue
        for spelling in KNOWN_SPELLINGS[role]:
            if spelling in special_added or (wordpiece and spelling in vocab):
                tokens[role], where[role] = spelling, f"the special token named {spelling}"
                break

    missing = [role for role in REQUIRED_ROLES if role not in tokens]
    if missing:
        named = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} or {missing[-1]}"
        where_not = [f"no {' / '.join(r + '_token' for r in missing)} in a tokenizer_config.json or "
                     "special_tokens_map.json beside it"]
        if {"cls", "sep"} & set(missing):
            where_not.append("no cls/sep around $A in its post-processor")
        spellings = ", ".join(" or ".join(KNOWN_SPELLINGS[role]) for role in missing)
        where_not.append(f"none of its special tokens (added_tokens marked special) is spelt {spellings}")
        raise SpecialTokensError(f"{source}: the tokenizer has no {named} token ({'; '.join(where_not)}); "
                                 "pretraining, fill-mask and fine-tuning need pad, cls, sep and mask")
    ids = {}
    for role, token in tokens.items():
        if token not in vocab:
            raise SpecialTokensError(f"{source}: its {role} token {token!r} (from {where[role]}) is not in its vocabulary")
        ids[role] = vocab[token]
    for role, template_id in template_ids.items():
        if template_tokens[role] != tokens[role]:
            raise SpecialTokensError(f"{source}: {where[role]} names {tokens[role]!r} as the {role} token, but its "
                                     f"post-processor's template puts {template_tokens[role]!r} there")
        if template_id != ids[role]:
            raise SpecialTokensError(f"{source}: the post-processor's template gives {template_tokens[role]!r} ({role}) "
                                     f"id {template_id}, its vocabulary id {ids[role]}")
    for role in ("pad", "cls", "sep"):
        if ids["mask"] == ids[role]:
            raise SpecialTokensError(f"{source}: its mask token {tokens['mask']!r} is also its {role} token")
    controls = set(ids.values()) | set(special_added.values())
    if wordpiece:
        controls |= {i for t, i in vocab.items() if is_bracketed(t)}
    return SpecialTokens(source, tokens, ids, tuple(sorted(controls)), where)


def _pre_tokenizers(config: Mapping) -> list[dict]:
    pre = config.get("pre_tokenizer")
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        return [p for p in pre.get("pretokenizers", []) if isinstance(p, dict)]
    return [pre]


def word_boundaries(config: Mapping | None) -> WordBoundaries:
    """Where words start, from a tokenizer.json's model and pre-tokenizer (None: a vocab.txt)."""
    if config is None:
        return WORDPIECE_WORDS
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    if model.get("type") == "WordPiece":
        return WordBoundaries("prefix", (model.get("continuing_subword_prefix") or "##",))
    if model.get("continuing_subword_prefix"):
        return WordBoundaries("prefix", (model["continuing_subword_prefix"],))
    for pre in _pre_tokenizers(config):
        if pre.get("type") == "ByteLevel":
            return WordBoundaries("marker", tuple(sorted(BYTE_LEVEL_WHITESPACE)))
        if pre.get("type") == "Metaspace":
            return WordBoundaries("marker", (pre.get("replacement") or "▁",))
    return WordBoundaries("none")
