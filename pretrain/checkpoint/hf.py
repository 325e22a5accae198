"""Hugging Face BERT directories <-> `LogicalCheckpoint`.

Reads BertForPreTraining, BertForMaskedLM and BertModel checkpoints (with or without the
`bert.` prefix; model.safetensors, pytorch_model.bin or their sharded index; TensorFlow-era
LayerNorm.gamma/beta names; a decoder weight stored tied or as an identical copy). Heads the
architecture does not have are initialised as our trainer would and listed in the notes.
Writes config.json + model.safetensors + tokenizer files that transformers' from_pretrained
loads with no missing or unexpected keys, as the architecture the checkpoint was trained as
(a converted BertForMaskedLM or BertModel comes back without the heads it never had) or one
asked for.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..config import Config
from ..common.atomic import directory_output
from ..data.preprocess.tokenizer import (SPECIAL_TOKENS, TokenizerError, load_tokenizer, read_vocab, tokenizer_model_type,
                                        tokenizer_vocab)
from ..model.names import MLM_BIAS, MODERN_EMBEDDINGS, WORD_EMBEDDINGS
from . import modernbert_hf
from .hf_config import (ARCHITECTURE_HEADS, ARCHITECTURES, MODEL_TYPES, PRETRAINING_ARCHITECTURES,  # noqa: F401 (re-exported)
                        config_from_hf, read_hf_config)
from .format import (CONFIG_JSON, HEADS, TOKENIZER_FILES, TOKENIZER_JSON, VOCAB_FILE, CheckpointError,
                     head_of, hf_parameter_info)
from .logical import LogicalCheckpoint, initialise_missing
from .sentence_transformers_config import write_sentence_transformers_config
from .tokenizer_files import check_vocab_fits, copy_vocab_files, has_tokenizer
from .trained_length import export_length, from_hf_dir

# Task heads of fine-tuned checkpoints: kept aside (LogicalCheckpoint.extra) for the fine-tuner.
TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DECODER_WEIGHT, DECODER_BIAS = "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"
BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
# ----------------------------------------------------------------------------- reading
def _load_weight_file(path: str) -> dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read weights ({type(e).__name__}: {e})") from None


def read_hf_weights(path: str) -> tuple[dict[str, torch.Tensor], str]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        if not name.endswith(".index.json"):
            return _load_weight_file(file), file
        with open(file) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(_load_weight_file(os.path.join(path, shard)))
        return state, file
    raise CheckpointError(f"{path}: no weights file (looked for {', '.join(WEIGHT_FILES)})")


def _canonical(name: str) -> str:
    """Our spelling of a Hugging Face key: `bert.` prefix, LayerNorm weight/bias."""
    if name.startswith(("embeddings.", "encoder.", "pooler.")):
        name = "bert." + name
    if name.endswith("LayerNorm.gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[: -len("beta")] + "bias"
    return name


def _untie_decoder(state: dict[str, torch.Tensor], file: str, modern: bool = False) -> None:
    """Drop the decoder copies that BERT ties to the word embeddings and the MLM bias (ModernBERT:
    its decoder.weight, tied to the token embedding; its decoder.bias is the MLM bias itself)."""
    decoder_weight, embeddings = ("decoder.weight", MODERN_EMBEDDINGS) if modern else (DECODER_WEIGHT, WORD_EMBEDDINGS)
    decoder = state.pop(decoder_weight, None)
    if decoder is not None and embeddings in state:
        if decoder.shape != state[embeddings].shape or not torch.equal(decoder, state[embeddings]):
            raise CheckpointError(f"{file}: {decoder_weight} differs from {embeddings}: this model has an "
                                  "untied MLM decoder, which our model ties to the token embeddings")
    if modern:
        return
    bias = state.pop(DECODER_BIAS, None)
    if bias is not None:
        if MLM_BIAS not in state:
            state[MLM_BIAS] = bias
        elif bias.shape != state[MLM_BIAS].shape or not torch.equal(bias, state[MLM_BIAS]):
            raise CheckpointError(f"{file}: {DECODER_BIAS} differs from {MLM_BIAS}")


def read_hf(path: str, seed: int = 1234) -> LogicalCheckpoint:
    """A Hugging Face BERT or ModernBERT directory as a LogicalCheckpoint; heads its architecture
    lacks are initialised (as the trainer initialises, from `seed`)."""
    hf, architecture = read_hf_config(path)
    cfg = config_from_hf(hf, os.path.join(path, CONFIG_JSON))
    modern = cfg.model.modern
    raw, file = read_hf_weights(path)
    state = {}
    for name, tensor in raw.items():
        canonical = modernbert_hf.canonical(name) if modern else _canonical(name)
        if canonical in state:
            raise CheckpointError(f"{file}: {name} and another key both mean {canonical}")
        state[canonical] = tensor
    for buffer in BUFFERS:
        state.pop(buffer, None)
    _untie_decoder(state, file, modern)
    inferred = architecture is None
    if inferred:  # old configs name no architecture: go by the heads present
        architecture = next(a for a, heads in ARCHITECTURE_HEADS.items()
                            if all(any(n.startswith(HEADS[h]) for n in state) for h in heads))

    info = hf_parameter_info(cfg.model)
    # a fine-tuned ModernBERT's `head.` is its task head's transform, not the MLM head's
    task_prefixes = TASK_HEAD_PREFIXES + (("head.",) if architecture in modernbert_hf.TASK_ARCHITECTURES else ())
    extra = {n: state.pop(n).to(torch.float32) for n in list(state) if n.startswith(task_prefixes)}
    unexpected = sorted(set(state) - set(info))
    mismatched = [f"{n}: file {tuple(state[n].shape)}, config.json implies {tuple(info[n].shape)}"
                  for n in info if n in state and tuple(state[n].shape) != tuple(info[n].shape)]
    required_heads = ARCHITECTURE_HEADS[architecture]
    missing = [n for n in info if n not in state]
    missing_required = [n for n in missing if head_of(n) is None or head_of(n) in required_heads]
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) for {architecture}: {', '.join(unexpected)}")
    if missing_required:
        problems.append(f"{len(missing_required)} missing tensor(s) for {architecture}: {', '.join(missing_required)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es):\n    " + "\n    ".join(mismatched))
    if problems:
        raise CheckpointError(f"{file}:\n  " + "\n  ".join(problems))

    notes = [f"read {architecture}{' (inferred: config.json names no architecture)' if inferred else ''} "
             f"from {file} ({len(raw)} tensors)"]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values()})
    if dtypes != ["float32"]:
        notes.append(f"weights stored as {', '.join(dtypes)}: converted to float32")
    weights = {n: state[n].to(torch.float32).contiguous() for n in info if n in state}
    if modern:
        weights = {n: modernbert_hf.to_native(n, t, cfg) for n, t in weights.items()}
    initialised = initialise_missing(weights, cfg, seed)
    for head, names in initialised.items():
        notes.append(f"{architecture} has no {head}: initialised {len(names)} tensor(s) "
                     f"(normal(0, {cfg.model.init_std}) weights, zero biases, unit LayerNorm; seed {seed}): "
                     + ", ".join(names))
    notes += _tokenizer_notes(path, cfg.model.vocab_size)
    return LogicalCheckpoint(config=cfg, weights=weights, source=path, vocab_dir=path if has_tokenizer(path) else None,
                             notes=notes, extra=extra, initialised_heads=sorted(initialised),
                             trained_length=from_hf_dir(path))


def _tokenizer_notes(path: str, vocab_size: int) -> list[str]:
    """What a conversion carries of the directory's tokenizer. A tokenizer.json is checked when
    it is written out (copy_vocab_files), not here: reading for training or fine-tuning uses it
    as it is."""
    present = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(path, name))]
    if not has_tokenizer(path):
        return [f"{path} has no {VOCAB_FILE} or {TOKENIZER_JSON}: the output carries no vocabulary"]
    if os.path.exists(os.path.join(path, VOCAB_FILE)):
        check_vocab_file(os.path.join(path, VOCAB_FILE), vocab_size)
        return [f"tokenizer files: {', '.join(present)}"]
    if tokenizer_model_type(os.path.join(path, TOKENIZER_JSON)) != "WordPiece":
        return [f"tokenizer files: {', '.join(present)} (a {tokenizer_model_type(os.path.join(path, TOKENIZER_JSON))} "
                f"tokenizer: no {VOCAB_FILE})"]
    return [f"tokenizer files: {', '.join(present)}; no {VOCAB_FILE}: a conversion writes the one {TOKENIZER_JSON} implies"]


def check_vocab_file(vocab_file: str, vocab_size: int) -> None:
    try:
        check_vocab_fits(read_vocab(vocab_file), vocab_size, vocab_file)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None


# ----------------------------------------------------------------------------- writing
def hf_config(cfg: Config, pad_token_id: int = 0, architecture: str = "BertForPreTraining") -> dict:
    m = cfg.model
    return {
        "architectures": [architecture],
        "model_type": "bert",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": m.hidden_dropout,
        "attention_probs_dropout_prob": m.attention_dropout,
        "max_position_embeddings": m.max_position_embeddings,
        "type_vocab_size": m.type_vocab_size,
        "initializer_range": m.init_std,
        "layer_norm_eps": m.layernorm_epsilon,
        "pad_token_id": pad_token_id,
        "position_embedding_type": "absolute",
        "classifier_dropout": None,
        "use_cache": True,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def _write_tokenizer_files(vocab_dir: str, out_dir: str, max_length: int, vocab_size: int) -> int:
    """The tokenizer files of vocab_dir as they are (plus the vocab.txt a tokenizer.json implies).
    A bare vocabulary (a trainer's checkpoint: vocab.txt, perhaps tokenizer.json) gets the
    tokenizer.json, tokenizer_config.json and special_tokens_map.json transformers loads it
    with; a directory with its own tokenizer_config.json keeps its settings. Returns [PAD]'s id."""
    vocab = copy_vocab_files(vocab_dir, out_dir)
    check_vocab_fits(vocab, vocab_size, vocab_dir)
    tokenizer_json = os.path.join(out_dir, TOKENIZER_JSON)
    if os.path.exists(os.path.join(out_dir, "tokenizer_config.json")):
        return vocab[SPECIAL_TOKENS[0]]
    source = {"tokenizer_json": tokenizer_json} if os.path.exists(tokenizer_json) else \
        {"vocab_file": os.path.join(out_dir, VOCAB_FILE)}
    try:
        info = load_tokenizer(**source, allow_case_mismatch=True)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if not os.path.exists(tokenizer_json):
        info.tokenizer.save(tokenizer_json)
    specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                "mask_token": "[MASK]"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": info.lowercase,
                   "model_max_length": max_length, **specials}, f, indent=2)
    if not os.path.exists(os.path.join(out_dir, "special_tokens_map.json")):
        with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
            json.dump(specials, f, indent=2)
    return info.special_ids[SPECIAL_TOKENS[0]]


def write_modern_tokenizer_files(source: str, out_dir: str, max_length: int, vocab_size: int) -> dict[str, int]:
    """A ModernBERT directory's tokenizer: the tokenizer files of `source` (a directory, or one
    tokenizer.json) as they are, plus the tokenizer_config.json transformers' AutoTokenizer needs
    when there is none. Returns the special token ids by role (pad, unk, cls, sep, mask), read
    from the tokenizer (read_special_tokens), never assumed."""
    if os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if name != VOCAB_FILE and os.path.exists(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    elif source.endswith(".json"):
        shutil.copyfile(source, os.path.join(out_dir, TOKENIZER_JSON))
    tokenizer_json = os.path.join(out_dir, TOKENIZER_JSON)
    if not os.path.exists(tokenizer_json):
        raise CheckpointError(f"{source}: a ModernBERT model needs its {TOKENIZER_JSON} (a vocab.txt alone is "
                              "a WordPiece vocabulary)")
    try:
        info = load_tokenizer(tokenizer_json=tokenizer_json, allow_case_mismatch=True)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    check_vocab_fits(tokenizer_vocab(info.tokenizer), vocab_size, tokenizer_json)
    specials = info.specials
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    if not os.path.exists(config_path):
        with open(config_path, "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                       "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
                       **{f"{role}_token": token for role, token in specials.tokens.items()}}, f, indent=2)
    return dict(specials.ids)


# ----------------------------------------------------------------------------- which heads
def trained_architecture(ckpt: LogicalCheckpoint) -> str:
    """The architecture of the heads that were trained. Heads read_hf initialised (those a
    BertForMaskedLM or BertModel directory lacks, recorded in the native meta.json through every
    conversion) never were: writing them would hand out random weights as a model's."""
    untrained = set(ckpt.initialised_heads)
    if ckpt.config.model.modern:
        return "ModernBertModel" if "MLM head" in untrained else "ModernBertForMaskedLM"
    if "MLM head" in untrained:
        return "BertModel"
    return "BertForMaskedLM" if untrained else "BertForPreTraining"


def written_heads(ckpt: LogicalCheckpoint, architecture: str) -> list[str]:
    heads = set(ARCHITECTURE_HEADS[architecture])
    if architecture == "BertModel" and "pooler" not in ckpt.initialised_heads:
        heads.add("pooler")  # BertModel's pooler is optional: kept when it was trained
    return [head for head in HEADS if head in heads]


def architecture_note(ckpt: LogicalCheckpoint, architecture: str) -> str:
    """One line on the heads written and left out, for the converter's report."""
    heads = written_heads(ckpt, architecture)
    untrained = [h for h in heads if h in ckpt.initialised_heads]
    # ModernBERT has no pooler or next-sentence head to leave out
    left_out = [h for h in HEADS if h not in heads and (h == "MLM head" or not ckpt.config.model.modern)]
    note = f"architecture {architecture}: encoder{''.join(', ' + h for h in heads)}"
    if untrained:
        note += f"; untrained (initialised when converted from a directory without them): {', '.join(untrained)}"
    if left_out and architecture == trained_architecture(ckpt):
        asks = "ModernBertForMaskedLM" if ckpt.config.model.modern else "BertForPreTraining"
        note += f"; left out {', '.join(left_out)} (never trained; --architecture {asks} writes them)"
    elif left_out:
        note += f"; left out {', '.join(left_out)}"
    return note


def _written_tensors(ckpt: LogicalCheckpoint, architecture: str) -> dict[str, torch.Tensor]:
    """The architecture's tensors by the names its transformers class saves: a BertModel's have
    no `bert.` prefix; a fine-tuned model adds its task head (ckpt.extra)."""
    heads = written_heads(ckpt, architecture)
    info = hf_parameter_info(ckpt.config.model)
    names = [n for n in info if head_of(n) is None or head_of(n) in heads]
    if ckpt.config.model.modern:  # transformers' row orders; a bare ModernBertModel has no `model.` prefix
        tensors = {n.removeprefix("model.") if architecture == "ModernBertModel" else n:
                   modernbert_hf.to_hf(n, ckpt.weights[n], ckpt.config) for n in names}
    else:
        tensors = {n.removeprefix("bert.") if architecture == "BertModel" else n: ckpt.weights[n] for n in names}
    if architecture not in PRETRAINING_ARCHITECTURES:
        tensors.update(ckpt.extra or {})
    return {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}


def write_hf(ckpt: LogicalCheckpoint, out_dir: str, vocab_file: str | None = None,
             architecture: str | None = None, config_extra: dict | None = None,
             sentence_embedding: dict | None = None) -> list[str]:
    """Write `ckpt` as a Hugging Face directory (temporary sibling directory, renamed into place
    when complete) of `architecture`, by default the one it was trained as (trained_architecture).
    Returns the files written. A fine-tuned model names its `architecture` (e.g.
    BertForSequenceClassification): its encoder and pooler, plus the task head in ckpt.extra,
    plus `config_extra` (num_labels, id2label, ...) in config.json. An encoder architecture also
    gets the sentence-transformers files: mean pooling at the trained length, or the
    `sentence_embedding` settings of a contrastively trained one (pooling, normalize, max_seq_length)."""
    from safetensors.torch import save_file

    architecture = architecture or trained_architecture(ckpt)
    family = MODEL_TYPES[modernbert_hf.MODEL_TYPE if ckpt.config.model.modern else "bert"]
    if architecture not in family:
        raise CheckpointError(f"architecture {architecture!r} is not one of this {ckpt.config.model.architecture} "
                              f"model's: {', '.join(family)}")
    vocab_dir = ckpt.vocab_dir
    if vocab_file is not None:
        if not os.path.exists(vocab_file):
            raise CheckpointError(f"--vocab-file {vocab_file} does not exist")
        check_vocab_file(vocab_file, ckpt.config.model.vocab_size)
        vocab_dir = None
    elif vocab_dir is None:
        raise CheckpointError(f"{ckpt.source} carries no {VOCAB_FILE} or {TOKENIZER_JSON} (trained on synthetic "
                              "data, or converted without one): pass --vocab-file")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"{out_dir} already exists and is not empty; choose a new output directory")
    with directory_output(out_dir, "the Hugging Face model") as tmp:
        m = ckpt.config.model
        length = export_length(ckpt.trained_length, m.max_position_embeddings)
        if m.modern:
            special_ids = write_modern_tokenizer_files(vocab_file or vocab_dir, tmp, length, m.vocab_size)
            config = modernbert_hf.modern_hf_config(ckpt.config, architecture, special_ids)
        else:
            if vocab_file is not None:
                shutil.copyfile(vocab_file, os.path.join(tmp, VOCAB_FILE))
            pad_id = _write_tokenizer_files(tmp if vocab_file is not None else vocab_dir, tmp, length, m.vocab_size)
            config = hf_config(ckpt.config, pad_id, architecture)
        _state_length(tmp, length, ckpt.trained_length)
        save_file(_written_tensors(ckpt, architecture), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_JSON), "w") as f:
            json.dump({**config, **(config_extra or {})}, f, indent=2)
        if architecture in PRETRAINING_ARCHITECTURES:  # an encoder sentence-transformers loads as it is
            settings = {"max_seq_length": length, **(sentence_embedding or {})}
            write_sentence_transformers_config(tmp, hidden_size=m.hidden_size, **settings,
                                               do_lower_case=False)  # the tokenizer lowercases itself
    return sorted(os.listdir(out_dir))


def _state_length(out_dir: str, length: int, trained: int | None) -> None:
    """The trained length as the tokenizer's model_max_length, also where the source's own
    tokenizer_config.json (copied as it is) states another: transformers' pipelines and
    sentence-transformers read it there."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    if trained is None or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        settings = json.load(f)
    if settings.get("model_max_length") != length:
        settings["model_max_length"] = length
        with open(path, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)


__all__ = ["read_hf", "write_hf", "hf_config", "trained_architecture", "architecture_note", "ARCHITECTURES",
           "PRETRAINING_ARCHITECTURES", "TOKENIZER_FILES"]
