"""Training a vocabulary from raw text: a WordPiece one written as Google BERT's vocab.txt plus a
Hugging Face tokenizer.json, or a byte-level BPE one written as a tokenizer.json (ModernBERT's
and RoBERTa's kind of tokenizer).

WordPiece: Hugging Face ``tokenizers``' WordPieceTrainer behind the same normalizer and
pre-tokenizer the tokenizer applies later (tokenizer.bert_wordpiece_tokenizer), so the vocabulary
is learned from exactly the words it will see. Special tokens come first, so [PAD] is id 0 as in
Google's vocabularies (Google's also reserve [unused*] slots; we do not need them).

BPE, the ModernBERT way: a byte-level BPE (GPT-2's byte alphabet, so no text is ever unknown;
ByteLevel pre-tokenizer without a prefix space, ByteLevel decoder) learnt with BpeTrainer, then
the special tokens [UNK] [CLS] [SEP] [PAD] [MASK] added after the learnt entries (ModernBERT's
order; [MASK] strips the space before it, so "is [MASK]." puts no lone space token before it),
then [unused0], [unused1], ... (added special tokens, as ModernBERT's) until the vocabulary has
exactly the size asked for (ModernBERT rounds its 50,285 entries to 50,368, a multiple of 64).
Post-processor: ByteLevel offsets trimming, then the template ``[CLS] $A [SEP]`` (pair
``[CLS] $A [SEP] $B:1 [SEP]:1``). Beside it a tokenizer_config.json names the five special tokens
for transformers (PreTrainedTokenizerFast; our readers take the roles from it too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE, WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer, ByteLevel
from tokenizers.trainers import BpeTrainer, WordPieceTrainer

from ...common.atomic import atomic_outputs
from .corpus import PROBLEM_KINDS, CorpusError, expand_inputs, iter_documents, locate
from .tokenizer import SPECIAL_TOKENS, bert_wordpiece_tokenizer, check_special_tokens

__all__ = ["MODELS", "BPE_SPECIAL_TOKENS", "VocabOptions", "VocabReport", "train_wordpiece", "train_bpe",
           "write_vocab", "write_bpe", "build_vocab"]

MODELS = ("wordpiece", "bpe")
# A byte-level BPE's special tokens, in the order ModernBERT adds them after its learnt entries
BPE_SPECIAL_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
BYTE_ALPHABET = 256


@dataclass(frozen=True)
class VocabOptions:
    vocab_size: int = 30522  # BERT-base's size (specials and alphabet included)
    min_frequency: int = 2  # a merge must occur at least this often
    limit_alphabet: int = 1000  # keep at most this many initial characters (rare ones become [UNK]); WordPiece only
    lowercase: bool = True
    model: str = "wordpiece"  # wordpiece | bpe

    def problems(self) -> list[str]:
        out = []
        if self.model not in MODELS:
            out.append(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        elif self.model == "bpe" and self.vocab_size < BYTE_ALPHABET + len(BPE_SPECIAL_TOKENS):
            out.append(f"--vocab-size must be at least {BYTE_ALPHABET + len(BPE_SPECIAL_TOKENS)} for a byte-level BPE "
                       f"(256 bytes and {len(BPE_SPECIAL_TOKENS)} special tokens), got {self.vocab_size}")
        if self.vocab_size < len(SPECIAL_TOKENS) + 1:
            out.append(f"--vocab-size must be at least {len(SPECIAL_TOKENS) + 1}, got {self.vocab_size}")
        if self.min_frequency < 0:
            out.append(f"--min-frequency must be >= 0, got {self.min_frequency}")
        if self.limit_alphabet < 1:
            out.append(f"--limit-alphabet must be >= 1, got {self.limit_alphabet}")
        return out


@dataclass
class VocabReport:
    files: int = 0
    documents: int = 0
    text_chars: int = 0
    problem_counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # "file:line: message", the first few
    vocab_size: int = 0
    unused: int = 0  # BPE: [unused*] entries filling the vocabulary up to the size asked for
    outputs: list[str] = field(default_factory=list)


def train_wordpiece(texts: Iterable[str], options: VocabOptions) -> Tokenizer:
    """A BERT WordPiece tokenizer whose vocabulary is learned from ``texts``."""
    trainer = WordPieceTrainer(
        vocab_size=options.vocab_size,
        min_frequency=options.min_frequency,
        limit_alphabet=options.limit_alphabet,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    model = Tokenizer(WordPiece(unk_token="[UNK]"))
    model.normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                      lowercase=options.lowercase)
    model.pre_tokenizer = BertPreTokenizer()
    model.train_from_iterator(_batches(texts), trainer=trainer)
    vocab = model.get_vocab()
    check_special_tokens(vocab, "trained vocabulary")
    # Rebuild with the full pipeline (decoder, template, registered specials) around the result.
    return bert_wordpiece_tokenizer(vocab, options.lowercase)


def train_bpe(texts: Iterable[str], options: VocabOptions) -> tuple[Tokenizer, int]:
    """A byte-level BPE tokenizer learnt from ``texts`` with the special tokens added the
    ModernBERT way (module docstring), exactly ``options.vocab_size`` entries; returns it and the
    number of [unused*] entries that fill it up."""
    trainer = BpeTrainer(
        vocab_size=options.vocab_size - len(BPE_SPECIAL_TOKENS),
        min_frequency=options.min_frequency,
        initial_alphabet=ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer = Tokenizer(BPE())  # no unk_token: every byte is in the alphabet
    if options.lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_batches(texts), trainer=trainer)
    learnt = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False, lstrip=token == "[MASK]")
                                  for token in BPE_SPECIAL_TOKENS])
    unused = options.vocab_size - learnt - len(BPE_SPECIAL_TOKENS)
    if unused > 0:
        tokenizer.add_special_tokens([AddedToken(f"[unused{i}]", special=True, normalized=False)
                                      for i in range(unused)])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True, add_prefix_space=False),
        processors.TemplateProcessing(single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
                                      special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]),
    ])
    return tokenizer, max(unused, 0)


def _batches(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    # Batches let the trainer count words on several threads.
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_vocab(tokenizer: Tokenizer, vocab_path: str, tokenizer_json_path: str | None) -> None:
    """vocab.txt (one token per line, by id) and optionally tokenizer.json, each written under a
    temporary name and renamed when complete."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("vocabulary ids are not contiguous from 0")  # cannot happen with WordPieceTrainer
    finals = [vocab_path] + ([tokenizer_json_path] if tokenizer_json_path else [])
    with atomic_outputs(finals) as temps:
        with open(temps[vocab_path], "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in tokens))
        if tokenizer_json_path:
            tokenizer.save(temps[tokenizer_json_path], pretty=True)


def bpe_tokenizer_config(lowercase: bool) -> dict:
    """tokenizer_config.json for a train_bpe tokenizer: transformers' names of its special tokens."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "do_lower_case": lowercase,
            "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
            "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": "[MASK]"}


def write_bpe(tokenizer: Tokenizer, tokenizer_json_path: str, config_path: str, lowercase: bool) -> None:
    """tokenizer.json and tokenizer_config.json, each written under a temporary name and renamed
    when complete."""
    with atomic_outputs([tokenizer_json_path, config_path]) as temps:
        tokenizer.save(temps[tokenizer_json_path], pretty=True)
        with open(temps[config_path], "w", encoding="utf-8") as f:
            json.dump(bpe_tokenizer_config(lowercase), f, indent=2)
            f.write("\n")


def build_vocab(inputs: Sequence[str], input_format: str, json_keys: Sequence[str], options: VocabOptions,
                vocab_path: str, tokenizer_json_path: str | None, strict: bool = False,
                max_reported: int = 5, replace_larger: bool = False) -> VocabReport:
    """Train on the documents of ``inputs`` and write the files; malformed lines are skipped and
    counted (an error under ``strict``). No text read is an error (CorpusError naming the files,
    the skips and the likely cause), and so is replacing an existing vocabulary (vocab.txt; for
    BPE, tokenizer.json) by a smaller one, unless ``replace_larger``: nothing is written then.
    BPE (``options.model``) writes ``tokenizer_json_path`` and a tokenizer_config.json beside it;
    ``vocab_path`` is not written."""
    problems = options.problems()
    if problems:
        raise ValueError("; ".join(problems))
    paths = expand_inputs(inputs, input_format)
    report = VocabReport(files=len(paths))

    def texts() -> Iterator[str]:
        line_base = {}  # file -> lines of its chunks so far (chunks come in order)
        for chunk, parsed in iter_documents(paths, input_format, json_keys):
            base = line_base.get(chunk.path, 0)
            line_base[chunk.path] = base + parsed.lines
            for kind, count in parsed.problem_counts.items():
                report.problem_counts[kind] = report.problem_counts.get(kind, 0) + count
            for p in parsed.problems:
                located = locate(chunk, base + p.line, p.message)
                if strict:
                    raise CorpusError(f"{located} (--strict)")
                if len(report.problems) < max_reported:
                    report.problems.append(located)
            for values in parsed.documents:
                report.documents += 1
                for text in values:
                    report.text_chars += len(text)
                    yield text

    bpe = options.model == "bpe"
    if bpe:
        if not tokenizer_json_path:
            raise ValueError("a BPE vocabulary is written as a tokenizer.json: give its path")
        tokenizer, report.unused = train_bpe(texts(), options)
    else:
        tokenizer = train_wordpiece(texts(), options)
    report.problem_counts = {k: report.problem_counts[k] for k in PROBLEM_KINDS if k in report.problem_counts}
    if report.text_chars == 0:
        raise CorpusError(_nothing_read(paths, input_format, json_keys, report))
    report.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    kept = tokenizer_json_path if bpe else vocab_path
    existing = _json_entries(kept) if bpe else _entries(kept)
    if existing is not None and existing > report.vocab_size and not replace_larger:
        raise CorpusError(f"{kept} holds {existing:,} entries and this corpus gives {report.vocab_size:,} "
                          f"({report.documents:,} documents, {report.text_chars:,} characters): not replaced "
                          "(--force replaces it; or choose another --output-dir)")
    if bpe:
        config_path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_json_path)), "tokenizer_config.json")
        write_bpe(tokenizer, tokenizer_json_path, config_path, options.lowercase)
        report.outputs = [tokenizer_json_path, config_path]
        return report
    write_vocab(tokenizer, vocab_path, tokenizer_json_path)
    report.outputs = [vocab_path] + ([tokenizer_json_path] if tokenizer_json_path else [])
    return report


def _nothing_read(paths: Sequence[str], input_format: str, json_keys: Sequence[str], report: VocabReport) -> str:
    named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    skipped = sum(report.problem_counts.values())
    message = f"no text read from {named} (--input-format {input_format}"
    message += f", --json-keys {' '.join(json_keys)})" if input_format == "jsonl" else ")"
    if skipped:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in report.problem_counts.items())
        message += f": {skipped:,} line(s) skipped ({kinds})"
        if report.problems:
            message += f", the first {report.problems[0]}"
    if input_format == "jsonl" and report.problem_counts.get("bad JSON"):
        message += "; a plain-text corpus needs --input-format text-lines or text-blank-lines"
    elif input_format == "jsonl" and report.problem_counts.get("missing key"):
        message += "; --json-keys names the key holding the text"
    elif not skipped:
        message += ": the input is empty"
    return message


def _entries(vocab_path: str) -> int | None:
    """Lines of an existing vocabulary file, or None."""
    try:
        with open(vocab_path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return None


def _json_entries(tokenizer_json: str) -> int | None:
    """Entries of an existing tokenizer.json (added tokens included), or None (none, or unreadable:
    then it is replaced)."""
    try:
        return Tokenizer.from_file(tokenizer_json).get_vocab_size(with_added_tokens=True)
    except Exception:  # tokenizers raises a bare Exception on a missing or bad file
        return None



