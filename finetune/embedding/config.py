"""The configuration of contrastive training (`python -m finetune embed`): YAML sections with dotted
overrides, pretrain.config's loader and rules (unknown keys and wrong types are errors, every
problem reported at once). Torch-free."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from pretrain.config import ConfigError, load_sections
from pretrain.config.precision import precision_problems

from ..config import ParallelSection

POOLING_MODES = ("mean", "cls", "last")  # loss.py's (not imported here: torch)
RETRIEVAL_METRICS = ("ndcg@10", "mrr@10", "recall@100")
SIMILARITY_METRIC = "spearman"


@dataclass
class DataSection:
    # (anchor, positive[, negatives]) rows: .jsonl/.json (one object per line), .tsv with a header row, or .parquet
    train_files: list[str] = field(default_factory=list)
    anchor_column: str = "anchor"
    positive_column: str = "positive"
    # hard negatives: columns of one negative each, or one column holding a list; every row the same count
    negative_columns: list[str] = field(default_factory=list)
    # the column naming each row's dataset: every batch then comes from one source (null: one pool)
    source_column: str | None = None
    max_seq_length: int = 128  # tokens per text ([CLS] text [SEP]); longer texts are cut, and counted

    def problems(self) -> list[str]:
        p = []
        if not self.train_files:
            p.append("data.train_files is required: JSON lines, TSV or Parquet files of (anchor, positive[, negatives]) rows")
        p += _missing_paths(self.train_files)
        if self.max_seq_length < 8:
            p.append(f"data.max_seq_length ({self.max_seq_length}) must be at least 8")
        return p


@dataclass
class EvalSection:
    # retrieval (BEIR's layout): queries and corpus as JSON lines ({"_id", "text"}, the corpus's
    # optional "title" put before its text), qrels as TSV (query-id, corpus-id, score; a header row)
    queries: str | None = None
    corpus: str | None = None
    qrels: str | None = None
    # semantic similarity: JSON lines or TSV of scored pairs (the three columns below), Spearman of the cosine
    similarity_file: str | None = None
    sentence1_column: str = "sentence1"
    sentence2_column: str = "sentence2"
    score_column: str = "score"
    # what picks the best checkpoint: ndcg@10, mrr@10, recall@100 or spearman (null: ndcg@10 with a
    # retrieval set, else spearman); with no evaluation set, the last step's weights are kept
    metric: str | None = None
    interval: int = 0  # evaluate every this many steps; 0: at the end of each epoch
    batch_size: int = 64  # texts per forward, per rank

    def retrieval(self) -> bool:
        return bool(self.queries or self.corpus or self.qrels)

    def selection_metric(self) -> str | None:
        if self.metric:
            return self.metric
        if self.retrieval():
            return "ndcg@10"
        return SIMILARITY_METRIC if self.similarity_file else None

    def problems(self) -> list[str]:
        p = _missing_paths([self.queries, self.corpus, self.qrels, self.similarity_file])
        given = [bool(self.queries), bool(self.corpus), bool(self.qrels)]
        if any(given) and not all(given):
            p.append("eval.queries, eval.corpus and eval.qrels go together: retrieval needs all three")
        if self.metric is not None:
            if self.metric not in RETRIEVAL_METRICS + (SIMILARITY_METRIC,):
                p.append(f"eval.metric {self.metric!r} must be one of {', '.join(RETRIEVAL_METRICS + (SIMILARITY_METRIC,))}")
            elif self.metric == SIMILARITY_METRIC and not self.similarity_file:
                p.append("eval.metric spearman needs eval.similarity_file")
            elif self.metric in RETRIEVAL_METRICS and not self.retrieval():
                p.append(f"eval.metric {self.metric} needs eval.queries, eval.corpus and eval.qrels")
        if self.interval < 0 or self.batch_size < 1:
            p.append("eval.interval must be >= 0 and eval.batch_size >= 1")
        return p


@dataclass
class ModelSection:
    init_from: str = ""  # native checkpoint (any layout) or Hugging Face BERT / ModernBERT directory
    vocab_file: str | None = None  # default: the checkpoint's own vocab.txt / tokenizer.json
    pooling: str = "mean"  # mean over the real tokens, cls (the first token) or last (the last real token)
    normalize: bool = True  # the exported model L2-normalises its embeddings (training scores by cosine either way)
    hidden_dropout: float | None = None  # None: the checkpoint's
    attention_dropout: float | None = None

    def problems(self) -> list[str]:
        p = _missing_paths([self.vocab_file])
        if self.pooling not in POOLING_MODES:
            p.append(f"model.pooling {self.pooling!r} must be one of {', '.join(POOLING_MODES)}")
        if not self.init_from:
            p.append("model.init_from is required: a native checkpoint or a Hugging Face BERT or ModernBERT directory")
        elif not os.path.exists(self.init_from):
            p.append(f"model.init_from {self.init_from} does not exist")
        return p


@dataclass
class LossSection:
    """sentence-transformers' MultipleNegativesRankingLoss (loss.py)."""
    scale: float = 20.0  # the cosine similarities' multiplier (1 / temperature)
    symmetric: bool = False  # also each positive against every anchor
    # the loss summed over the embeddings cut to each of these leading dimensions (MatryoshkaLoss); [] off
    matryoshka_dims: list[int] = field(default_factory=list)
    matryoshka_weights: list[float] = field(default_factory=list)  # one per dimension; [] all 1

    def problems(self) -> list[str]:
        p = []
        if not self.scale > 0:
            p.append(f"loss.scale ({self.scale}) must be > 0")
        if any(d < 1 for d in self.matryoshka_dims) or len(set(self.matryoshka_dims)) != len(self.matryoshka_dims):
            p.append(f"loss.matryoshka_dims {self.matryoshka_dims} must be distinct dimensions >= 1")
        if self.matryoshka_weights and len(self.matryoshka_weights) != len(self.matryoshka_dims):
            p.append(f"loss.matryoshka_weights has {len(self.matryoshka_weights)} weights for "
                     f"{len(self.matryoshka_dims)} loss.matryoshka_dims")
        return p


@dataclass
class TrainSection:
    epochs: float = 1.0
    # (anchor, positive) rows per step over all data-parallel ranks: every anchor is scored against
    # every candidate of the global batch (its positives and hard negatives, all ranks' gathered)
    global_batch_size: int = 64
    # texts per forward pass, per rank; below a rank's share (global_batch_size / data-parallel size)
    # the step is gradient-cached (GradCache: the same update at the memory of this many); null: the share
    micro_batch_size: int | None = None
    lr: float = 2e-5
    warmup_ratio: float = 0.1  # share of the steps with linear warmup, then linear decay to 0
    weight_decay: float = 0.01  # not on biases and LayerNorm
    grad_clip: float = 1.0
    seed: int = 42
    precision: str = "fp32"
    grad_accum_dtype: str = "fp32"  # bf16 only: accumulate and reduce gradients in fp32 (ZeRO >= 1) or bf16
    # true: the texts of a pass packed several to a row of data.max_seq_length tokens, each attending
    # to itself only (no padding computed but a row's tail); false: each padded to the pass's longest
    packing: bool = True
    # rows cut to the fullest (packed) or the longest text (padded), rounded up to a multiple of this
    # (null: 8 on a GPU, 1 on the CPU)
    pad_to_multiple_of: int | None = None
    output_dir: str = "outputs/embed"
    overwrite_output_dir: bool = False  # replace a previous run's metrics.json, best/ and tensorboard/
    tensorboard_dir: str | None = None  # default: <output_dir>/tensorboard
    keep_best: bool = True  # the best evaluation's weights as a sentence-transformers model in <output_dir>/best
    log_interval: int = 10
    progress: bool = True
    tf32: bool = True
    hang_timeout_minutes: float = 15.0  # no step, evaluation batch or save for this long: stacks written, exit 124

    def problems(self) -> list[str]:
        p = []
        if self.global_batch_size < 2:
            p.append(f"train.global_batch_size ({self.global_batch_size}) must be >= 2: in-batch negatives need a batch")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            p.append(f"train.micro_batch_size ({self.micro_batch_size}) must be >= 1 (or null)")
        if self.precision not in ("fp32", "bf16"):
            p.append(f"train.precision {self.precision!r} must be fp32 or bf16")
        if self.epochs <= 0 or self.lr <= 0 or not 0 <= self.warmup_ratio < 1:
            p.append("train.epochs and train.lr must be > 0 and 0 <= train.warmup_ratio < 1")
        if self.hang_timeout_minutes < 0 or self.log_interval < 1:
            p.append("train.hang_timeout_minutes must be >= 0 and train.log_interval >= 1")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            p.append(f"train.pad_to_multiple_of ({self.pad_to_multiple_of}) must be >= 1 (or null: by device)")
        return p


SECTIONS: dict[str, type] = {"data": DataSection, "eval": EvalSection, "model": ModelSection, "loss": LossSection,
                             "parallel": ParallelSection, "train": TrainSection}


@dataclass
class EmbedConfig:
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    model: ModelSection = field(default_factory=ModelSection)
    loss: LossSection = field(default_factory=LossSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def share(self, world_size: int) -> int:
        """Rows of each global batch one data-parallel rank embeds."""
        return self.train.global_batch_size // (world_size // self.parallel.tensor_parallel)

    def validate(self, world_size: int) -> None:
        p, t = self.parallel, self.train
        problems = (self.data.problems() + self.eval.problems() + self.model.problems() + self.loss.problems()
                    + p.problems() + t.problems())
        if p.tensor_parallel < 1 or world_size % p.tensor_parallel:
            problems.append(f"parallel.tensor_parallel ({p.tensor_parallel}) must divide the world size ({world_size})")
        elif t.global_batch_size % (world_size // p.tensor_parallel):
            problems.append(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of the "
                            f"data-parallel size ({world_size // p.tensor_parallel})")
        if t.precision in ("fp32", "bf16") and p.zero_stage in (0, 1, 2):
            problems += precision_problems(t.precision, t.grad_accum_dtype, p.zero_stage)
        if problems:
            raise ConfigError(problems)


def _missing_paths(paths: Sequence[str | None]) -> list[str]:
    return [f"{path} does not exist" for path in paths if path and not os.path.exists(path)]


def load_embed_config(path: str | None, overrides: Sequence[str] = ()) -> EmbedConfig:
    tree = load_sections(path, overrides, SECTIONS)
    return EmbedConfig(**{name: cls(**tree.get(name, {})) for name, cls in SECTIONS.items()})
