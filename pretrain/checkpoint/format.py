"""What a checkpoint is on disk: its names, paths and meta.json. Nothing here loads a tensor.

Layout of a `save_dir` the trainer writes (exact.py):
  latest                      tag of the newest *complete* checkpoint (moved last, atomically)
  <tag>/meta.json             step, consumed samples, parallel layout, model shape, config, and
                              the name, size and CRC32 of every other file of the checkpoint
  <tag>/rng_rank<R>.pt        per-rank Python/NumPy/torch RNG states and the dropout streams
  <tag>/vocab.txt, tokenizer.json   the run's tokenizer (tokenizer_files.py)
  <tag>/...                   DeepSpeed's mp_rank_*/layer_*/zero_pp_rank_* files (named below)
  <tag>.partial/              a save in progress, or one that was killed: never loaded

Converted checkpoints (logical.py) have the same layout, written as one ZeRO-0 fp32 process
per model shard, with "exact_resume": false in meta.json.
"""
from __future__ import annotations

import glob
import json
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ..config import Config, ConfigError
from ..model.names import HF_NAME_TABLE, TIED_EMBEDDING_KEY, module_parameters, spec_modules
from .errors import CheckpointError  # noqa: F401 (re-exported)
from .filenames import (CONFIG_JSON, LATEST, META, PARTIAL, REPLACED, TAG_PATTERN, TOKENIZER_JSON,  # noqa: F401
                        VOCAB_FILE)  # (re-exported)
from .series import complete_tags, named_by_latest  # noqa: F401 (complete_tags re-exported)

MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state carried per parameter (LAMB and AdamW)
# Every tokenizer file a Hugging Face directory may hold: transformers 5 writes tokenizer.json and
# tokenizer_config.json only, older versions vocab.txt, special_tokens_map.json, added_tokens.json too.
TOKENIZER_FILES = (VOCAB_FILE, TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# Model fields that change parameter shapes: a checkpoint only loads into the same values.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_size",
                "max_position_embeddings", "type_vocab_size", "make_vocab_size_divisible_by")
# ModernBERT's fields that change which parameters exist (in model_shape as well, for it only)
MODERN_SHAPE_FIELDS = ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias")


# Parameters by head (Hugging Face name prefix): a checkpoint of an architecture without a head,
# or trained without the binary head, gets them initialised and listed as untrained.
HEADS = {"pooler": ("bert.pooler.",), "next-sentence head": ("cls.seq_relationship.",),
         "MLM head": ("cls.predictions.", "head.", "decoder.")}  # BERT's, then ModernBERT's


def head_of(hf_name: str) -> str | None:
    """The head a parameter belongs to (None: the encoder)."""
    return next((head for head, prefix in HEADS.items() if hf_name.startswith(prefix)), None)


# shape keys that are not a model.<key> of the config
SHAPE_NAMES = {"binary_head": "binary (next-sentence) head, from data.segment_pairs",
               "ffn_size": "model.ffn_hidden_size (the feed-forward width; unset = 4 x model.hidden_size)"}


def tag_for(step: int) -> str:
    return f"iter_{step:07d}"


def rng_file(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, f"rng_rank{rank:05d}.pt")


# ----------------------------------------------------------------------------- DeepSpeed's files
def model_ranks(tp: int, pp: int) -> list[tuple[int, int, int]]:
    """(pipeline rank, tensor rank, DeepSpeed's model-parallel file rank) of every model shard."""
    return [(p, t, p * tp + t if pp > 1 else t) for p in range(pp) for t in range(tp)]


def stage_spec_range(model_cfg, pp: int, stage: int) -> range:
    if pp == 1:
        return range(len(spec_modules(model_cfg)))
    bounds = pipeline_stage_bounds(model_cfg, pp)
    return range(bounds[stage], bounds[stage + 1])


def layer_file(tag_dir: str, spec: int, tp_rank: int) -> str:
    return os.path.join(tag_dir, f"layer_{spec:02d}-model_{tp_rank:02d}-model_states.pt")


def mp_file(tag_dir: str, mp_rank: int) -> str:
    return os.path.join(tag_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")


def zero_file(tag_dir: str, prefix: str, dp_rank: int, mp_rank: int, what: str) -> str:
    return os.path.join(tag_dir, f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_{what}_states.pt")


def expected_files(tag_dir: str, layout: dict, model_cfg) -> list[str]:
    """Every file DeepSpeed writes for this layout (plus our meta.json)."""
    tp, pp, dp, zero = (layout["tensor_parallel"], layout["pipeline_parallel"], layout["data_parallel"],
                        layout["zero_stage"])
    files = [os.path.join(tag_dir, META)]
    optim_prefix = "bf16_" if layout.get("precision") == "bf16" else ""
    for p, t, m in model_ranks(tp, pp):
        if zero == 3:  # DeepSpeed prefixes only the optimizer files with bf16_
            files += [zero_file(tag_dir, "", d, m, "model") for d in range(dp)]
            files += [zero_file(tag_dir, optim_prefix, d, m, "optim") for d in range(dp)]
            continue
        files.append(mp_file(tag_dir, m))
        if pp > 1:
            specs = [s for s in stage_spec_range(model_cfg, pp, p) if s != len(spec_modules(model_cfg)) - 2]
            files += [layer_file(tag_dir, s, t) for s in specs]
        if zero in (1, 2) or (pp > 1 and optim_prefix):
            files += [zero_file(tag_dir, optim_prefix, d, m, "optim") for d in range(dp)]
    return files


def check_complete(tag_dir: str, layout: dict, model_cfg) -> None:
    missing = [os.path.basename(f) for f in expected_files(tag_dir, layout, model_cfg) if not os.path.exists(f)]
    if missing:
        raise CheckpointError(f"{tag_dir} is incomplete (half-written, or files were removed): missing "
                              f"{len(missing)} file(s): {', '.join(missing)}")


# ----------------------------------------------------------------------------- parameter names
class HfParameter(NamedTuple):
    shape: tuple[int, ...]  # the whole tensor, unpadded vocabulary
    kind: str  # weight, bias, layernorm or embedding (optimizer groups)
    partition_dim: int | None  # the dimension TP cuts it along; None: replicated


def pipeline_stage_bounds(model_cfg, pipeline_parallel: int) -> list[int]:
    """Spec index where each pipeline stage starts (plus the end), as PipelineModule's
    "type:<transformer layer class>" partitioning computes it."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [0 if layer is None else 1 for _, layer in spec_modules(model_cfg)]
    return partition_balanced(weights=weights, num_parts=pipeline_parallel)


def checkpoint_param_names(model_cfg, pipelined: bool, binary_head: bool = True) -> list[tuple[int, str, str]]:
    """(spec index, parameter name in the engine's module, Hugging Face name) of every parameter,
    in each spec's order; the tied word embedding once, at its first use (spec 0).

    SequentialBert names them tied.word_embeddings.* and layers.<k>.* (k counts the untied
    specs); DeepSpeed's PipelineModule tied_modules.word_embeddings.* and <spec index>.*.
    """
    names, untied = [], 0
    specs = spec_modules(model_cfg, binary_head)
    for index, (kind, layer) in enumerate(specs):
        tied = kind is specs[0][0]  # the word embedding, also the tied decoder
        if tied and index > 0:
            continue
        if tied:
            prefix = f"tied_modules.{TIED_EMBEDDING_KEY}" if pipelined else f"tied.{TIED_EMBEDDING_KEY}"
        else:
            prefix = str(index) if pipelined else f"layers.{untied}"
            untied += 1
        for local in module_parameters(kind, model_cfg, layer):
            hf_name = HF_NAME_TABLE[kind][local].hf_name.format(i=layer if layer is not None else "")
            names.append((index, f"{prefix}.{local}", hf_name))
    return names


def hf_parameter_info(model_cfg, binary_head: bool = True) -> dict[str, HfParameter]:
    """Hugging Face name -> its whole shape (unpadded vocabulary), kind and TP partition dim; without
    `binary_head`, no pooler and no next-sentence classifier."""
    h, f, v = model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.vocab_size
    shapes = {
        "embedding.weight": (v, h), "position_embeddings.weight": (model_cfg.max_position_embeddings, h),
        "token_type_embeddings.weight": (model_cfg.type_vocab_size, h), "intermediate.weight": (f, h),
        "intermediate.bias": (f,), "output.weight": (h, f), "nsp.weight": (2, h), "nsp.bias": (2,), "bias": (v,),
        # ModernBERT
        "attn_qkv.weight": (3 * h, h), "attn_qkv.bias": (3 * h,), "mlp_in.weight": (2 * f, h),
        "mlp_in.bias": (2 * f,), "mlp_out.weight": (h, f),
    }
    info = {}
    for kind, layer in spec_modules(model_cfg, binary_head):
        for local in module_parameters(kind, model_cfg, layer):
            entry = HF_NAME_TABLE[kind][local]
            default = (h,) if local.endswith("bias") or "norm" in local else (h, h)
            info[entry.hf_name.format(i=layer if layer is not None else "")] = HfParameter(
                shapes.get(local, default), entry.kind, entry.partition_dim)
    return info


def stage_param_names(model_cfg, pp: int, stage: int, binary_head: bool = True) -> list[tuple[str, str]]:
    """(engine parameter name, HF name) of one pipeline stage, in the module's parameter order:
    the tied word embedding first on the stages that use it (first and last), then by spec."""
    specs = stage_spec_range(model_cfg, pp, stage)
    decoder_spec = len(spec_modules(model_cfg)) - 2  # the tied embedding's second use
    names = []
    for index, name, hf_name in checkpoint_param_names(model_cfg, pipelined=pp > 1, binary_head=binary_head):
        tied = index == 0
        if (tied and (0 in specs or decoder_spec in specs)) or (not tied and index in specs):
            names.append((name, hf_name))
    return names



# ----------------------------------------------------------------------------- meta.json
def layout_of(cfg: Config, parallel) -> dict:
    return {
        "tensor_parallel": parallel.tp_size,
        "pipeline_parallel": parallel.pp_size,
        # DeepSpeed's data-parallel size, whose ranks write the ZeRO files: context x data (the
        # weights hold no trace of CP; its ranks are replicas to DeepSpeed)
        "data_parallel": parallel.dp_cp_size,
        "context_parallel": parallel.cp_size,
        "zero_stage": cfg.parallel.zero_stage,
        "precision": cfg.train.precision,
        # bf16's gradient dtype picks DeepSpeed's optimizer wrapper (ZeRO-1: BF16_Optimizer for fp32,
        # DeepSpeedZeroOptimizer for bf16), whose files the other cannot load
        "grad_accum_dtype": cfg.train.grad_accum_dtype if cfg.train.precision == "bf16" else None,
        "optimizer": cfg.optimizer.name,
    }


def model_shape_of(cfg: Config) -> dict:
    shape = {**{name: getattr(cfg.model, name) for name in SHAPE_FIELDS}, "binary_head": cfg.binary_head}
    if cfg.model.modern:
        shape.update(architecture=cfg.model.architecture, **{name: getattr(cfg.model, name) for name in MODERN_SHAPE_FIELDS})
    return shape


def read_meta(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, META)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete checkpoint of this trainer")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSON syntax, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if not isinstance(meta, dict) or any(key not in meta for key in ("layout", "config")):
        raise CheckpointError(f"{path}: not the meta.json of a checkpoint of this trainer (no layout or config)")
    return meta


# ----------------------------------------------------------------------------- fingerprints
# A file's fingerprint is the CRC32 of each of its 256 MiB blocks: the blocks of all the files a
# rank checks are read by a thread pool (zlib releases the GIL), so its share takes several cores.
_BLOCK_BYTES = 256 << 20


def _block_crc32(path: str, start: int) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:  # no copy
        with memoryview(mapped) as whole, whole[start:start + _BLOCK_BYTES] as block:
            return zlib.crc32(block)


def crc32s(paths: list[str]) -> dict[str, str]:
    """path -> its fingerprint: the CRC32 of each 256 MiB block as 8 hex digits, space-separated
    ("1a2b3c4d" for a file of one block). Catches a file damaged or overwritten in place with its
    size kept (not tampering). Raises OSError for a file that cannot be read."""
    blocks = [(path, start) for path in paths for start in range(0, os.path.getsize(path), _BLOCK_BYTES)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = list(pool.map(lambda block: _block_crc32(*block), blocks))
    by_path: dict[str, list[str]] = {path: [] for path in paths}
    for (path, _), crc in zip(blocks, sums):
        by_path[path].append(f"{crc:08x}")
    return {path: " ".join(found) or f"{0:08x}" for path, found in by_path.items()}  # an empty file: 00000000


def checkpoint_files(tag_dir: str) -> list[str]:
    """Every file under tag_dir but meta.json (relative paths, sorted): what meta.json lists."""
    names = [os.path.relpath(os.path.join(root, name), tag_dir) for root, _, files in os.walk(tag_dir) for name in files]
    return sorted(name for name in names if name != META)


def fingerprints(tag_dir: str, names: list[str], share: tuple[int, int] = (0, 1)) -> dict[str, str]:
    """name -> fingerprint of this share (rank, ranks) of `names`: the ranks of a job each read a part."""
    rank, ranks = share
    mine = names[rank::ranks]
    found = crc32s([os.path.join(tag_dir, name) for name in mine])
    return {name: found[os.path.join(tag_dir, name)] for name in mine}


def content_problems(tag_dir: str, meta: dict, share: tuple[int, int] = (0, 1)) -> list[str]:
    """The files of this share whose fingerprint differs from the one meta.json recorded at the
    save (checkpoints saved before fingerprints were recorded: none)."""
    recorded = meta.get("crc32", {})
    rank, ranks = share
    mine = sorted(recorded)[rank::ranks]
    unreadable = [name for name in mine if not os.path.isfile(os.path.join(tag_dir, name))]
    problems = [f"{os.path.join(tag_dir, name)} is missing: checkpoint {tag_dir} is damaged" for name in unreadable]
    readable = [name for name in mine if name not in unreadable]
    actual = fingerprints(tag_dir, readable)
    problems += [f"{os.path.join(tag_dir, name)} has other bytes than when it was saved (CRC32 {actual[name]}, "
                 f"{recorded[name]} in {META}: damaged or overwritten in place): checkpoint {tag_dir} is damaged"
                 for name in readable if actual[name] != recorded[name]]
    return problems


def damaged(problems: list[str]) -> CheckpointError:
    more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
    return CheckpointError(problems[0] + more)


def verify_checkpoint(tag_dir: str, contents: bool = False) -> dict:
    """Check a checkpoint before loading any of it: meta.json readable, and every file it lists
    present with the size it had when saved; with `contents`, also with the same CRC32 (reads
    every file: a job's ranks share that work instead, content_problems). Returns the meta.
    (Checkpoints written before meta.json listed the files are checked for meta.json only.)"""
    meta = read_meta(tag_dir)
    files = meta.get("files", {})
    missing = [name for name in files if not os.path.isfile(os.path.join(tag_dir, name))]
    if len(missing) == 1:
        raise CheckpointError(f"{os.path.join(tag_dir, missing[0])} is missing: checkpoint {tag_dir} is damaged "
                              f"(saved with {len(files)} files besides {META})")
    if missing:
        raise CheckpointError(f"checkpoint {tag_dir} is damaged: missing {len(missing)} of its {len(files)} files "
                              f"besides {META}: {', '.join(missing)}")
    for name, size in files.items():
        path = os.path.join(tag_dir, name)
        actual = os.path.getsize(path)
        if actual != size:
            raise CheckpointError(f"{path} has {actual} bytes, {size} when saved (truncated or overwritten): "
                                  f"checkpoint {tag_dir} is damaged")
    problems = content_problems(tag_dir, meta) if contents else []
    if problems:
        raise damaged(problems)
    return meta


def config_of(meta: dict, tag_dir: str) -> Config:
    try:
        return Config.from_stored(meta["config"], source=f"{tag_dir}/{META}")
    except ConfigError as e:
        raise CheckpointError(f"{tag_dir}/{META}: invalid config:\n  " + "\n  ".join(e.problems)) from None


def layout_differences(meta: dict, cfg: Config, parallel) -> list[str]:
    ours = layout_of(cfg, parallel)
    saved = {"context_parallel": 1, **meta["layout"]}  # checkpoints from before CP: 1
    return [f"{key}: checkpoint {saved.get(key)} vs run {ours[key]}"
            for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel", "zero_stage",
                        "precision", "grad_accum_dtype", "optimizer")
            if saved.get(key) != ours[key]]


def shape_differences(saved_shape: dict, cfg: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """The model fields in which a checkpoint's shape (meta.json's model_shape) differs from the
    run's, except those in `ignore` (e.g. the vocabulary padding, a layout matter that layout-free
    loading re-pads)."""
    saved_shape = {"binary_head": True, "architecture": "bert", **saved_shape}  # older checkpoints: BERT with it
    ours = model_shape_of(cfg)
    ours.setdefault("architecture", "bert")
    return [f"{SHAPE_NAMES.get(key, 'model.' + key)}: checkpoint {saved_shape.get(key)} vs run {value}"
            for key, value in ours.items()
            if saved_shape.get(key) != value and key not in ignore]


def restores_exactly(meta: dict, cfg: Config, parallel) -> bool:
    """A checkpoint the trainer wrote in this very layout: DeepSpeed restores it bit for bit."""
    return meta.get("exact_resume", True) and not layout_differences(meta, cfg, parallel) \
        and not shape_differences(meta["model_shape"], cfg)


def check_compatible(meta: dict, cfg: Config, parallel, path: str) -> None:
    """Refuse a checkpoint of another layout or model shape, listing every difference."""
    differences = layout_differences(meta, cfg, parallel) + shape_differences(meta["model_shape"], cfg)
    if differences:
        raise CheckpointError(f"checkpoint {path} does not match this run's layout:\n  " + "\n  ".join(differences))


# ----------------------------------------------------------------------------- locating
def latest_tag(load_dir: str) -> str | None:
    """The tag `latest` names, after checking that checkpoint is whole (verify_checkpoint): a
    damaged one raises CheckpointError naming the file, before anything is loaded. None when
    load_dir holds no `latest` yet."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    tag_dir = os.path.join(load_dir, tag)
    if not tag or not os.path.isdir(tag_dir):
        aside = tag_dir + REPLACED
        if tag and os.path.isdir(aside) and os.path.exists(os.path.join(aside, META)):
            try:  # a save replacing this step's checkpoint was killed between its two renames
                os.rename(aside, tag_dir)
            except OSError:
                pass  # another rank took it back first
        if not tag or not os.path.isdir(tag_dir):
            raise CheckpointError(f"{path} names {tag!r}, which is not a directory in {load_dir}")
    try:
        verify_checkpoint(tag_dir)
    except CheckpointError as e:
        raise with_older_checkpoints(e, load_dir, tag) from None
    return tag


def with_older_checkpoints(error: CheckpointError, load_dir: str, tag: str) -> CheckpointError:
    """The error about a damaged checkpoint, with the older ones a resume could use instead."""
    older = [name for name in complete_tags(load_dir) if name != tag][-3:]
    hint = f"; older checkpoints: {', '.join(older)} (write one's name into {os.path.join(load_dir, LATEST)} to resume from it)"
    return CheckpointError(f"{error}{hint if older else ''}")


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory: either one tag directory, or a save_dir (its `latest`, checked
    whole as a resume checks it)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if os.path.exists(os.path.join(path, META)):
        return path
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(PARTIAL) and TAG_PATTERN.fullmatch(name[:-len(PARTIAL)]):
        save_dir = os.path.dirname(os.path.normpath(path)) or "."
        raise CheckpointError(f"{path} is an unfinished save (in progress, or killed before it completed), not a "
                              f"checkpoint; {complete_ones(save_dir)}")
    tag = latest_tag(path)
    if tag is not None:
        return os.path.join(path, tag)
    if glob.glob(os.path.join(path, "iter_*")):
        raise CheckpointError(f"{path} has iter_* directories but no '{LATEST}' file; {complete_ones(path)}")
    raise CheckpointError(f"{path} is not a checkpoint of this trainer (no {META} and no '{LATEST}' file)")


def complete_ones(save_dir: str, shown: int = 5) -> str:
    """The complete checkpoints of save_dir as paths to pass instead: the one `latest` names first,
    then the others newest first (an unfinished <tag>.partial never)."""
    tags = complete_tags(save_dir)[::-1]
    if not tags:
        return f"{save_dir} holds no complete checkpoint yet"
    named = named_by_latest(save_dir)
    if named in tags:
        tags.remove(named)
        tags.insert(0, named)
    listed = [os.path.join(save_dir, tag) + (f" ({LATEST})" if tag == named else "") for tag in tags[:shown]]
    more = f" and {len(tags) - shown} older" if len(tags) > shown else ""
    return f"pass a complete checkpoint: {', '.join(listed)}{more}"
