"""Our checkpoints as whole logical tensors: read from any layout, written at any TP x PP.

A trainer checkpoint is DeepSpeed's files for the layout it was trained in (format.py,
exact.py). `read_native` puts the pieces back together without any process group:

* weights: the fp32 master copy where DeepSpeed keeps one (ZeRO-1/2/3 partitions, the bf16
  optimizers), else the module states (ZeRO-0 fp32); TP shards concatenated along each
  parameter's partition dimension (HF_NAME_TABLE), pipeline stages joined, vocabulary padding
  dropped;
* optimizer moments (exp_avg, exp_avg_sq) per parameter the same way, plus the step counts.

`write_native` writes that state at a chosen TP x PP in the files of a one-process-per-model-
shard ZeRO-0 fp32 run (module states, the optimizer's state by parameter index), with a
meta.json saying it is not an exact-resume checkpoint: the trainer then loads it through
load.py, into any DP size and ZeRO stage.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..config import Config
from ..common.atomic import directory_output
from ..model.bert import full_initial_value
from ..model.names import spec_modules
from ..optim.groups import group_by_kind
from .format import (LATEST, META, MOMENTS, CheckpointError, check_complete, checkpoint_files, config_of, fingerprints,
                     head_of, hf_parameter_info, layer_file, model_ranks, model_shape_of, mp_file, resolve_tag_dir,
                     stage_param_names, stage_spec_range, tag_for, verify_checkpoint, zero_file)
from .sharding import local_value, unpad_vocab
from .tokenizer_files import check_vocab_fits, copy_vocab_files, has_tokenizer
from .trained_length import KEY as TRAINED_LENGTH, from_native_meta

@dataclass
class LogicalCheckpoint:
    """A model (and optionally its optimizer) as whole fp32 tensors keyed by Hugging Face name,
    with the unpadded vocabulary."""

    config: Config
    weights: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] | None = None  # name -> {exp_avg, exp_avg_sq}
    optimizer_step: int = 0  # the optimizer's own step count (bias correction)
    step: int = 0
    consumed_samples: int = 0
    scheduler_steps: int = 0  # LR scheduler's completed steps (last_epoch)
    source: str = ""
    vocab_dir: str | None = None  # directory holding the tokenizer files (vocab.txt and/or tokenizer.json), if any
    notes: list[str] = field(default_factory=list)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # a fine-tuned model's task head (HF names)
    # heads the source did not have, filled with fresh initial values (format.HEADS names, e.g.
    # "MLM head" for a BertModel directory); kept through write_native so tools can tell untrained heads
    initialised_heads: list[str] = field(default_factory=list)
    # the longest sequence length the weights were trained at, every phase included (trained_length.py);
    # None: unknown. What an export states as the model's length
    trained_length: int | None = None


def _load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # a truncated or foreign file: say which
        raise CheckpointError(f"{path}: cannot be read as a checkpoint file ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- reading one model shard
def _as_int(step) -> int:
    return int(step.item()) if torch.is_tensor(step) else int(step)


class _ShardReader:
    """The fp32 weights and moments of one model shard (pipeline stage p, tensor rank t), by
    engine parameter name, from whichever files this layout has."""

    def __init__(self, tag_dir: str, layout: dict, cfg: Config, p: int, t: int, m: int):
        self.tag_dir, self.layout, self.cfg = tag_dir, layout, cfg
        self.p, self.t, self.m = p, t, m
        self.pp, self.dp, self.zero = layout["pipeline_parallel"], layout["data_parallel"], layout["zero_stage"]
        self.names = stage_param_names(cfg.model, self.pp, p, cfg.binary_head)
        self.weights: dict[str, torch.Tensor] = {}
        self.moments: dict[str, dict[str, torch.Tensor]] = {}
        self.optimizer_step: int | None = None
        self.scheduler_steps: int | None = None
        self._layer_cache: tuple[str, dict] | None = None  # one pipeline layer file at a time

    def read(self, with_optimizer: bool) -> None:
        prefix = "bf16_" if self.layout.get("precision") == "bf16" else ""
        if self.zero == 3:
            self._read_zero3(prefix, with_optimizer)
            return
        mp_state = _load(mp_file(self.tag_dir, self.m))
        self.scheduler_steps = _as_int((mp_state.get("lr_scheduler") or {}).get("last_epoch", 0))
        zero_files = [zero_file(self.tag_dir, prefix, d, self.m, "optim") for d in range(self.dp)]
        if all(os.path.exists(f) for f in zero_files) and (self.zero in (1, 2) or prefix):
            self._read_flat_partitions(zero_files, mp_state, with_optimizer)
            return
        self._read_module(mp_state)
        optimizer = mp_state.get("optimizer")
        if optimizer is None:  # converted without optimizer state
            return
        if "fp32_groups" in optimizer:  # bf16 with ZeRO-0: whole fp32 copies per parameter
            grouped = self._grouped_names(optimizer["optimizer_state_dict"])
            for names, masters in zip(grouped, optimizer["fp32_groups"]):
                for name, master in zip(names, masters):
                    self.weights[name] = master.float()
            optimizer = optimizer["optimizer_state_dict"]
        if with_optimizer:
            self._read_indexed_state(optimizer)

    # module states: the weights in the training precision (fp32 for ZeRO-0 fp32)
    def _read_module(self, mp_state: dict) -> None:
        if self.pp == 1:
            module = mp_state["module"]
            for name, _ in self.names:
                if name not in module:
                    raise CheckpointError(f"{mp_file(self.tag_dir, self.m)}: no tensor {name}")
                self.weights[name] = module[name].float()
            return
        for name, _ in self.names:
            spec, local = _split_pipeline_name(name)
            path = layer_file(self.tag_dir, spec, self.t)
            layer = self._layer(path)
            if local not in layer:
                raise CheckpointError(f"{path}: no tensor {local}")
            self.weights[name] = layer[local].float()

    def _layer(self, path: str) -> dict:
        if self._layer_cache is None or self._layer_cache[0] != path:
            self._layer_cache = (path, _load(path))
        return self._layer_cache[1]

    def _grouped_names(self, optimizer_state: dict) -> list[list[str]]:
        """Engine parameter names of each param group of a by-index optimizer state."""
        o = self.cfg.optimizer
        info = hf_parameter_info(self.cfg.model, self.cfg.binary_head)
        groups = group_by_kind([(name, info[hf].kind) for name, hf in self.names], o.no_weight_decay,
                               o.no_layer_adaptation)
        grouped = [names for _, _, names in groups]
        saved = [len(g["params"]) for g in optimizer_state["param_groups"]]
        if saved != [len(g) for g in grouped]:
            raise CheckpointError(f"{mp_file(self.tag_dir, self.m)}: optimizer param groups hold {saved} "
                                  f"parameters, the model's grouping gives {[len(g) for g in grouped]}")
        return grouped

    def _read_indexed_state(self, optimizer_state: dict) -> None:
        grouped = self._grouped_names(optimizer_state)
        for names, group in zip(grouped, optimizer_state["param_groups"]):
            for name, index in zip(names, group["params"]):
                state = optimizer_state["state"].get(index)
                if not state:
                    continue  # never stepped
                self.moments[name] = {k: state[k].float() for k in MOMENTS}
                self.optimizer_step = _as_int(state["step"])

    # ZeRO-1/2 and the bf16 optimizer: flat fp32 partitions per param group and DP rank, with
    # DeepSpeed's map of which fragment of which parameter each holds
    def _read_flat_partitions(self, zero_files: list[str], mp_state: dict, with_optimizer: bool) -> None:
        shapes = {name: shape for group in mp_state["param_shapes"] for name, shape in group.items()}
        pieces: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for path in zero_files:
            sd = _load(path)["optimizer_state_dict"]
            flats = sd["single_partition_of_fp32_groups"]
            base = sd["base_optimizer_state"]["state"]
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                state = base.get(g, {})
                if state and "step" in state:
                    self.optimizer_step = _as_int(state["step"])
                for name, address in mapping.items():
                    sources = [("weight", flats[g])] + [(k, state[k]) for k in MOMENTS if with_optimizer and k in state]
                    for what, flat in sources:
                        pieces.setdefault(name, []).append((what, flat.narrow(0, address.start, address.numel)))
        for name, _ in self.names:
            if name not in shapes or name not in pieces:
                raise CheckpointError(f"{self.tag_dir}: ZeRO partitions of model rank {self.m} lack {name}")
            for what in ("weight", *MOMENTS):
                parts = [v for w, v in pieces[name] if w == what]
                if not parts:
                    continue
                tensor = torch.cat(parts).float()
                if tensor.numel() != math.prod(shapes[name]):
                    raise CheckpointError(f"{self.tag_dir}: the ZeRO fragments of {name} (model rank {self.m}) "
                                          f"add up to {tensor.numel()} elements, its shape is {tuple(shapes[name])}")
                tensor = tensor.view(shapes[name])
                if what == "weight":
                    self.weights[name] = tensor
                else:
                    self.moments.setdefault(name, {})[what] = tensor

    # ZeRO-3: each parameter split into dp equal parts (the last padded), one per DP rank, laid
    # end to end in parameter order in the rank's flat fp32 groups
    def _read_zero3(self, prefix: str, with_optimizer: bool) -> None:
        model_states = [_load(zero_file(self.tag_dir, "", d, self.m, "model")) for d in range(self.dp)]
        self.scheduler_steps = _as_int((model_states[0].get("lr_scheduler") or {}).get("last_epoch", 0))
        shapes = [(name, shape) for group in model_states[0]["param_shapes"] for name, shape in group.items()]
        flats: dict[str, list[torch.Tensor]] = {"weight": [], "exp_avg": [], "exp_avg_sq": []}
        for d in range(self.dp):
            sd = _load(zero_file(self.tag_dir, prefix, d, self.m, "optim"))["optimizer_state_dict"]
            flats["weight"].append(torch.cat([f.flatten() for f in sd["fp32_flat_groups"]]))
            states = [sd["optimizer_state_dict"]["state"].get(g) for g in range(len(sd["fp32_flat_groups"]))]
            if with_optimizer and all(states):
                for k in MOMENTS:
                    flats[k].append(torch.cat([s[k].flatten() for s in states]))
                self.optimizer_step = _as_int(states[0]["step"])
        offset = 0
        for name, shape in shapes:
            numel = math.prod(shape)
            part = math.ceil(numel / self.dp)
            for what, per_rank in flats.items():
                if not per_rank:
                    continue
                tensor = torch.cat([f.narrow(0, offset, part) for f in per_rank])[:numel].float().view(shape)
                if what == "weight":
                    self.weights[name] = tensor
                else:
                    self.moments.setdefault(name, {})[what] = tensor
            offset += part
        if offset != flats["weight"][0].numel():
            raise CheckpointError(f"{self.tag_dir}: ZeRO-3 partitions of model rank {self.m} hold "
                                  f"{flats['weight'][0].numel()} elements per rank, the parameters {offset}")
        missing = [name for name, _ in self.names if name not in self.weights]
        if missing:
            raise CheckpointError(f"{self.tag_dir}: ZeRO-3 files of model rank {self.m} lack {', '.join(missing)}")


def _split_pipeline_name(name: str) -> tuple[int, str]:
    """PipelineModule parameter name -> (spec index of its layer file, name inside that file)."""
    head, local = name.split(".", 1)
    if head == "tied_modules":
        return 0, local.split(".", 1)[1]
    return int(head), local


# ----------------------------------------------------------------------------- the public reader
def read_native(path: str, with_optimizer: bool = True) -> LogicalCheckpoint:
    """Whole fp32 tensors (HF names, unpadded vocabulary) of the checkpoint at `path` (a save_dir
    or one of its iter_* directories), from any TP x PP x DP layout and ZeRO stage."""
    tag_dir = resolve_tag_dir(path)
    meta = verify_checkpoint(tag_dir, contents=True)  # sizes and CRC32s: this reads every file anyway
    cfg = config_of(meta, tag_dir)
    layout = meta["layout"]
    tp, pp = layout["tensor_parallel"], layout["pipeline_parallel"]
    check_complete(tag_dir, layout, cfg.model)
    info = hf_parameter_info(cfg.model, cfg.binary_head)

    by_hf: dict[str, dict[int, torch.Tensor]] = {}
    moments_by_hf: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    steps, scheduler_steps = set(), None
    for p, t, m in model_ranks(tp, pp):
        shard = _ShardReader(tag_dir, layout, cfg, p, t, m)
        shard.read(with_optimizer)
        for name, hf_name in shard.names:
            if hf_name in by_hf and t in by_hf[hf_name]:
                continue  # the tied embedding's second copy, on the last stage
            by_hf.setdefault(hf_name, {})[t] = shard.weights[name]
            if name in shard.moments:
                moments_by_hf.setdefault(hf_name, {})[t] = shard.moments[name]
        if shard.optimizer_step is not None:
            steps.add(shard.optimizer_step)
        if scheduler_steps is None:
            scheduler_steps = shard.scheduler_steps

    def whole(hf_name: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
        shape, _, dim = info[hf_name]
        tensor = pieces[0] if dim is None or tp == 1 else torch.cat([pieces[t] for t in range(tp)], dim=dim)
        tensor = unpad_vocab(hf_name, tensor, cfg.model.vocab_size)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{tag_dir}: {hf_name} reassembles to {tuple(tensor.shape)}, the config "
                                  f"says {tuple(shape)}")
        return tensor.contiguous()  # may still be backed by the memory-mapped file: read-only use

    weights = {hf_name: whole(hf_name, by_hf[hf_name]) for hf_name in info}
    moments = None
    if with_optimizer and moments_by_hf:
        if set(moments_by_hf) != set(info):
            missing = sorted(set(info) - set(moments_by_hf))
            raise CheckpointError(f"{tag_dir}: optimizer state lacks {len(missing)} parameter(s): {', '.join(missing)}")
        moments = {hf: {k: whole(hf, {t: v[k] for t, v in per_t.items()}) for k in MOMENTS}
                   for hf, per_t in moments_by_hf.items()}
    if len(steps) > 1:
        raise CheckpointError(f"{tag_dir}: model shards disagree on the optimizer step ({sorted(steps)})")
    initialised = set(meta.get("initialised_heads", []))
    notes = []
    if not cfg.binary_head:
        # Trained without the binary head: its pooler and classifier are initialised here, as a
        # BertForMaskedLM directory's are (checkpoint/hf.py), so that every reader sees a whole
        # BertForPreTraining; they are marked untrained, and conversion writes BertForMaskedLM.
        added = initialise_missing(weights, cfg, seed=cfg.train.seed)
        initialised |= set(added)
        notes.append(f"trained without the binary head (data.segment_pairs none): initialised "
                     f"{', '.join(sorted(added))}")
    return LogicalCheckpoint(
        config=cfg, weights=weights, moments=moments, optimizer_step=steps.pop() if steps else 0,
        step=int(meta.get("step", 0)), consumed_samples=int(meta.get("consumed_samples", 0)),
        scheduler_steps=scheduler_steps or 0, source=tag_dir,
        vocab_dir=tag_dir if has_tokenizer(tag_dir) else None,
        initialised_heads=sorted(initialised), notes=notes, trained_length=from_native_meta(meta),
    )


def initialise_missing(weights: dict[str, torch.Tensor], cfg: Config, seed: int) -> dict[str, list[str]]:
    """Add to `weights` every BertForPreTraining tensor it lacks, initialised as the trainer
    initialises (per-name seeds from `seed`); returns the names added, by head."""
    added: dict[str, list[str]] = {}
    for name, (shape, kind, _) in hf_parameter_info(cfg.model).items():
        if name not in weights:
            weights[name] = full_initial_value(name, kind, shape, cfg.model, seed)
            added.setdefault(head_of(name), []).append(name)
    return added


# ----------------------------------------------------------------------------- writing
def check_layout(cfg: Config, tp: int, pp: int) -> None:
    """The layout rules the model's shapes impose (the rest of validate() is about the run)."""
    m, problems = cfg.model, []
    if tp < 1 or pp < 1:
        problems.append(f"tensor and pipeline parallel sizes must be >= 1 (got TP {tp}, PP {pp})")
    else:
        if m.num_attention_heads % tp:
            problems.append(f"TP {tp} does not divide the {m.num_attention_heads} attention heads")
        if m.ffn_size % tp:
            problems.append(f"TP {tp} does not divide the feed-forward size {m.ffn_size}")
        if m.padded_vocab_size(tp) % tp:
            problems.append(f"TP {tp} does not divide the padded vocabulary {m.padded_vocab_size(tp)}")
        if pp > m.num_layers:
            problems.append(f"PP {pp} exceeds the {m.num_layers} transformer layers")
    if problems:
        raise CheckpointError("cannot lay the model out that way:\n  " + "\n  ".join(problems))


def _indexed_optimizer_state(ckpt: LogicalCheckpoint, names: list[tuple[str, str]], local) -> dict:
    """A ZeRO-0 optimizer's state_dict for one model shard: state by parameter index, in the
    trainer's param-group order."""
    o, info = ckpt.config.optimizer, hf_parameter_info(ckpt.config.model, ckpt.config.binary_head)
    groups = group_by_kind([(hf, info[hf].kind) for _, hf in names], o.no_weight_decay, o.no_layer_adaptation)
    state, param_groups, index = {}, [], 0
    for decay, adapt, members in groups:
        ids = []
        for hf in members:
            state[index] = {"step": ckpt.optimizer_step, **{k: local(hf, ckpt.moments[hf][k]) for k in MOMENTS}}
            ids.append(index)
            index += 1
        param_groups.append({"weight_decay": o.weight_decay if decay else 0.0, "layer_adaptation": adapt,
                             "lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "params": ids})
    return {"state": state, "param_groups": param_groups}


def write_native(ckpt: LogicalCheckpoint, out_dir: str, tp: int, pp: int, with_optimizer: bool = True,
                 converted_from: str = "") -> str:
    """Write `ckpt` as a native checkpoint at TP x PP into out_dir (which must not exist or be
    empty). Everything goes to a temporary sibling directory renamed into place at the end, so
    a failure never leaves out_dir looking complete. Returns the tag directory."""
    cfg = Config.from_dict(ckpt.config.to_dict())
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    check_layout(cfg, tp, pp)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"{out_dir} already exists and is not empty; choose a new output directory")
    with_optimizer = with_optimizer and ckpt.moments is not None
    m = cfg.model
    info, padded = hf_parameter_info(m, cfg.binary_head), m.padded_vocab_size(tp)
    tag = tag_for(ckpt.step)
    with directory_output(out_dir, "the native checkpoint") as tmp:
        tag_dir = os.path.join(tmp, tag)
        os.makedirs(tag_dir)
        if ckpt.vocab_dir:  # first: a tokenizer that cannot be carried fails before the weights are written
            check_vocab_fits(copy_vocab_files(ckpt.vocab_dir, tag_dir), m.vocab_size, ckpt.vocab_dir)
        for p, t, mp in model_ranks(tp, pp):
            names = stage_param_names(m, pp, p, cfg.binary_head)

            def local(hf_name, tensor):
                return local_value(hf_name, tensor, padded, info[hf_name].partition_dim, t, tp)

            module = OrderedDict((name, local(hf, ckpt.weights[hf])) for name, hf in names)
            state = {
                "module": module if pp == 1 else None,
                "buffer_names": [],
                "optimizer": _indexed_optimizer_state(ckpt, names, local) if with_optimizer else None,
                "param_shapes": None,
                "lr_scheduler": {"last_epoch": ckpt.scheduler_steps, "_step_count": ckpt.scheduler_steps + 1},
                "skipped_steps": 0,
                "global_steps": ckpt.step,
                "global_samples": ckpt.consumed_samples,
                "dp_world_size": 1,
                "mp_world_size": tp * pp if pp > 1 else tp,
                "step": ckpt.step,
                "consumed_samples": ckpt.consumed_samples,
            }
            torch.save(state, mp_file(tag_dir, mp))
            if pp > 1:
                by_spec: dict[int, OrderedDict] = {}
                for name, _ in names:
                    spec, local_name = _split_pipeline_name(name)
                    by_spec.setdefault(spec, OrderedDict())[local_name] = module[name]
                decoder_spec = len(spec_modules(m)) - 2
                for spec, layer in by_spec.items():
                    if spec == 0 and 0 not in stage_spec_range(m, pp, p):
                        continue  # the last stage's copy of the tied embedding: DeepSpeed keeps the first
                    assert spec != decoder_spec
                    torch.save(layer, layer_file(tag_dir, spec, t))
        names = checkpoint_files(tag_dir)
        meta = {
            "step": ckpt.step,
            "consumed_samples": ckpt.consumed_samples,
            "world_size": tp * pp,
            "layout": {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": 1, "zero_stage": 0,
                       "precision": "fp32", "optimizer": cfg.optimizer.name},
            "model_shape": model_shape_of(cfg),
            "config": cfg.to_dict(),
            "exact_resume": False,  # no RNG or data-loader state: the trainer loads it layout-free
            "optimizer_state": with_optimizer,
            "converted_from": converted_from or ckpt.source,
            "initialised_heads": ckpt.initialised_heads,
            TRAINED_LENGTH: ckpt.trained_length,
            "files": {name: os.path.getsize(os.path.join(tag_dir, name)) for name in names},
            "crc32": fingerprints(tag_dir, names),
        }
        with open(os.path.join(tag_dir, META), "w") as f:
            json.dump(meta, f, indent=2)
        with open(os.path.join(tmp, LATEST), "w") as f:
            f.write(tag)
    return os.path.join(out_dir, tag)


