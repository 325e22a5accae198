"""Fine-tuning configuration: YAML sections with dotted overrides (pretrain.config's loader and
rules: unknown keys and wrong types are errors, all problems reported at once)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from pretrain.config import ConfigError, load_sections
from pretrain.config.precision import precision_problems


@dataclass
class TaskSection:
    name: str = ""  # a GLUE task (cola sst2 mrpc stsb qqp mnli qnli rte wnli), swag, squad (1.1), squad2 (2.0), conll2003
    data_dir: str | None = None  # the task's directory: GLUE's standard layout (train.tsv, dev.tsv, test.tsv), SWAG's train/val/test.csv
    train_file: str | None = None  # instead of data_dir/train.tsv: a .tsv (standard layout or named columns), .csv, .json or .jsonl
    dev_files: list[str] = field(default_factory=list)  # instead of the task's dev files
    test_files: list[str] = field(default_factory=list)  # instead of the task's test files (predictions only)
    text_a_column: str | None = None  # names of the columns of .csv/.json/.jsonl files and named .tsv (default: the task's usual names)
    text_b_column: str | None = None
    label_column: str = "label"
    max_seq_length: int = 128
    # tokenized inputs kept here and loaded by every later run with the same file, tokenizer and task
    # settings (finetune/input_cache.py; a sweep points all its runs at one); None: tokenize every run
    cache_dir: str | None = None
    # SQuAD (google-research/bert's run_squad.py defaults)
    doc_stride: int = 128  # step between the starts of a context's windows
    max_query_length: int = 64  # longer questions are truncated
    n_best_size: int = 20
    max_answer_length: int = 30  # tokens
    null_score_diff_threshold: float = 0.0  # 2.0: answer "" when null score - best score exceeds it
    # token classification (conll2003); doc_stride above is also the step between a long document's windows
    labels: list[str] = field(default_factory=list)  # IOB2 tag set, O and B-/I- of every type (default: CoNLL-2003's)
    tag_column: int = -1  # CoNLL-format column of the tags (0 is the word; CoNLL-2003: 1 POS, 2 chunk, 3 NER)
    tag_scheme: str = "auto"  # the files' scheme (iob1, iob2; auto: detected), in which predictions are written
    context: str = "document"  # document: windows over each -DOCSTART- document; sentence: each sentence alone

    def problems(self, tasks: Mapping[str, Any]) -> list[str]:
        """`tasks`: the task registry (finetune.tasks.TASKS), given by the caller: the task modules
        import this module's sections, so this module never imports them."""
        p = []
        if self.name not in tasks:
            p.append(f"task.name {self.name!r} must be one of {', '.join(tasks)}")
        if not (self.data_dir or self.train_file or self.dev_files):
            p.append(self._no_data(tasks))
        p += _missing_paths([self.data_dir, self.train_file, *self.dev_files, *self.test_files])
        if self.max_seq_length < 8:
            p.append(f"task.max_seq_length ({self.max_seq_length}) must be at least 8")
        if self.name in tasks:
            p += tasks[self.name].config_problems(self)
        if self.doc_stride < 1 or self.n_best_size < 1 or self.max_answer_length < 1:
            p.append("task.doc_stride, task.n_best_size and task.max_answer_length must be >= 1")
        return p


    def _no_data(self, tasks: Mapping[str, Any]) -> str:
        """The data keys to set, with the files task.data_dir holds for this task."""
        files = ""
        if self.name in tasks:
            task = tasks[self.name]
            files = f" (the directory of {self.name}'s {', '.join((task.train_file, *task.dev_files))})"
        return (f"task.data_dir is not set: give the task's directory on the command line, task.data_dir=DIR{files}, "
                "or its files: task.train_file=FILE task.dev_files=[FILE]")


@dataclass
class ModelSection:
    init_from: str = ""  # native checkpoint (any layout) or Hugging Face BERT / ModernBERT directory
    vocab_file: str | None = None  # default: the checkpoint's own vocab.txt / tokenizer.json
    classifier_dropout: float = 0.1
    hidden_dropout: float | None = None  # None: the checkpoint's
    attention_dropout: float | None = None
    # ModernBERT: how sequence and multiple-choice heads pool the last layer, cls (the first token)
    # or mean (over the real tokens); None: the checkpoint's model.classifier_pooling
    classifier_pooling: str | None = None

    def problems(self) -> list[str]:
        p = _missing_paths([self.vocab_file])
        if self.classifier_pooling not in (None, "cls", "mean"):
            p.append(f"model.classifier_pooling {self.classifier_pooling!r} must be cls or mean")
        if not self.init_from:
            p.append("model.init_from is required: a native checkpoint or a Hugging Face BERT or ModernBERT directory")
        elif not os.path.exists(self.init_from):
            p.append(f"model.init_from {self.init_from} does not exist")
        return p


@dataclass
class ParallelSection:
    tensor_parallel: int = 1
    zero_stage: int = 0  # 0, 1 or 2

    def problems(self) -> list[str]:
        if self.zero_stage not in (0, 1, 2):
            return [f"parallel.zero_stage ({self.zero_stage}) must be 0, 1 or 2 for fine-tuning"]
        return []


@dataclass
class TrainSection:
    epochs: float = 3.0
    global_batch_size: int = 32
    micro_batch_size: int = 8
    lr: float = 2e-5
    warmup_ratio: float = 0.1  # share of the steps with linear warmup, then linear decay to 0
    weight_decay: float = 0.01  # not on biases and LayerNorm
    grad_clip: float = 1.0
    seed: int = 42
    precision: str = "fp32"
    grad_accum_dtype: str = "fp32"  # bf16 only: accumulate and reduce gradients in fp32 (ZeRO >= 1) or bf16
    eval_batch_size: int = 32  # per rank
    # "longest": a batch is padded to its longest example, rounded up to a multiple of
    # pad_to_multiple_of (Hugging Face's DataCollatorWithPadding); "max_length": every batch to
    # task.max_seq_length (the fixed shapes of old). The same results either way, to rounding
    padding: str = "longest"
    # None: 8 on a GPU (tensor-core shapes, fewer distinct shapes), 1 on the CPU (where a longer
    # row is only more work: rounding to 8 computes 8% more tokens on the demo's sentence pairs)
    pad_to_multiple_of: int | None = None
    # training batches drawn from windows of LENGTH_GROUP_WINDOW global batches of the epoch's
    # shuffled order, sorted by length in each (Hugging Face's group_by_length): batches of like
    # lengths, the epoch still every example once in a seeded order
    group_by_length: bool = True
    output_dir: str = "outputs/finetune"
    # true: replace the outputs a previous run left in output_dir (metrics.json, best/, predictions/,
    # submission/, tensorboard/); false: a run into a directory holding any of them is refused before
    # it starts (see previous_outputs). Other files there (feature_cache/, the user's own) never count
    overwrite_output_dir: bool = False
    tensorboard_dir: str | None = None  # default: <output_dir>/tensorboard
    eval_only: bool = False  # evaluate (and predict) with model.init_from as it is
    keep_best: bool = True  # keep the weights of the best dev epoch in <output_dir>/best
    log_interval: int = 20
    progress: bool = True  # tqdm bars on the logging rank
    tf32: bool = True  # TF32 tensor cores for fp32 matrix products on GPUs (Ampere and later); no effect on CPU
    # no training step, evaluation batch or save finished for this long: every rank writes what it was
    # doing, which rank is stuck and every thread's stack, and ends (exit 124). 0 = no watchdog
    hang_timeout_minutes: float = 15.0

    def problems(self) -> list[str]:
        p = []
        if self.hang_timeout_minutes < 0:
            p.append(f"train.hang_timeout_minutes ({self.hang_timeout_minutes}) must be >= 0 (0 turns the watchdog off)")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            p.append(f"train.pad_to_multiple_of ({self.pad_to_multiple_of}) must be >= 1 (or null: by device)")
        if self.padding not in ("longest", "max_length"):
            p.append(f"train.padding {self.padding!r} must be longest or max_length")
        if self.precision not in ("fp32", "bf16"):
            p.append(f"train.precision {self.precision!r} must be fp32 or bf16")
        if self.epochs <= 0 or self.lr <= 0 or not 0 <= self.warmup_ratio < 1:
            p.append("train.epochs and train.lr must be > 0 and 0 <= train.warmup_ratio < 1")
        return p


@dataclass
class FeaturesSection:
    """The feature-based approach (python -m finetune TASK --feature-based; token classification):
    a BiLSTM tagger over the frozen encoder's cached hidden states. The paper's Table 7 setup."""

    layers: list[int] = field(default_factory=lambda: [-1, -2, -3, -4])  # concatenated; -1 last layer, 0 embeddings
    cache_dir: str | None = None  # default: <train.output_dir>/feature_cache
    output_dir: str | None = None  # default: <train.output_dir>/feature_based
    lstm_hidden: int = 768  # per direction (the paper's two-layer 768-dimensional BiLSTM)
    lstm_layers: int = 2
    dropout: float = 0.1  # on the features and the LSTM's outputs
    lr: float = 1e-3  # Adam
    epochs: int = 10
    batch_size: int = 32  # sentences

    def problems(self) -> list[str]:
        p = []
        if not self.layers or len(set(self.layers)) != len(self.layers):
            p.append(f"features.layers {self.layers} must name at least one layer, each once")
        if min(self.lstm_hidden, self.lstm_layers, self.epochs, self.batch_size) < 1:
            p.append("features.lstm_hidden, lstm_layers, epochs and batch_size must be >= 1")
        if not 0 <= self.dropout < 1 or self.lr <= 0:
            p.append("features.dropout must be in [0, 1) and features.lr > 0")
        return p


SECTIONS: dict[str, type] = {"task": TaskSection, "model": ModelSection, "parallel": ParallelSection,
                             "train": TrainSection, "features": FeaturesSection}


@dataclass
class FinetuneConfig:
    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    features: FeaturesSection = field(default_factory=FeaturesSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def validate(self, world_size: int, tasks: Mapping[str, Any], feature_based: bool = False) -> None:
        """Every section's rules, then the batch arithmetic over the world size; one ConfigError.
        tasks: the task registry (finetune.tasks.TASKS; see TaskSection.problems).
        feature_based: the run trains a tagger on frozen features (features section) instead."""
        p, tr = self.parallel, self.train
        problems = self.task.problems(tasks) + self.model.problems() + p.problems()
        if feature_based:
            problems += self.features.problems()
            if self.task.name in tasks and not tasks[self.task.name].feature_based:
                problems.append(f"--feature-based trains a token tagger; {self.task.name} is not token classification")
            if world_size != p.tensor_parallel:
                problems.append(f"--feature-based runs the encoder tensor-parallel only: the world size ({world_size}) "
                                f"must equal parallel.tensor_parallel ({p.tensor_parallel})")
        if p.tensor_parallel < 1 or world_size % p.tensor_parallel:
            problems.append(f"parallel.tensor_parallel ({p.tensor_parallel}) must divide the world size ({world_size})")
        else:
            dp = world_size // p.tensor_parallel
            if tr.global_batch_size % (tr.micro_batch_size * dp):
                problems.append(f"train.global_batch_size ({tr.global_batch_size}) must be a multiple of "
                                f"micro_batch_size x data-parallel size ({tr.micro_batch_size} x {dp})")
        problems += tr.problems()
        if tr.precision in ("fp32", "bf16") and p.zero_stage in (0, 1, 2):
            problems += precision_problems(tr.precision, tr.grad_accum_dtype, p.zero_stage)
        if problems:
            raise ConfigError(problems)


def _missing_paths(paths: list[str | None]) -> list[str]:
    return [f"{path} does not exist" for path in paths if path and not os.path.exists(path)]


# What a fine-tuning run (finetuner.py) writes into train.output_dir, in the order a refusal names
# them; it writes no config file there. Not among them: feature_cache/ (reused by every run) and the
# --feature-based run's feature_based/.
FINETUNE_OUTPUTS = ("metrics.json", "best", "predictions", "submission")


def previous_outputs(cfg: FinetuneConfig) -> list[str]:
    """What train.output_dir holds of the outputs a fine-tuning run writes there, directories with a
    trailing slash: the names above, and tensorboard/ when the run's events go there (train.tensorboard_dir
    unset). An empty directory holds nothing to lose and is not named."""
    out = cfg.train.output_dir
    names = FINETUNE_OUTPUTS + (("tensorboard",) if cfg.train.tensorboard_dir is None else ())
    found = []
    for name in names:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            if _not_empty(path):
                found.append(name + "/")
        elif os.path.lexists(path):
            found.append(name)
    return found


def _not_empty(directory: str) -> bool:
    try:
        return bool(os.listdir(directory))
    except OSError:  # unreadable: what it holds cannot be told, so it counts
        return True


def output_dir_problems(cfg: FinetuneConfig) -> list[str]:
    """One line when this run would replace a previous run's outputs (unless train.overwrite_output_dir)."""
    found = [] if cfg.train.overwrite_output_dir else previous_outputs(cfg)
    if not found:
        return []
    return [f"train.output_dir {cfg.train.output_dir} already holds a previous run's outputs ({', '.join(found)}), "
            "which this run would replace: give another train.output_dir, or set train.overwrite_output_dir=true "
            "to replace them"]


# the repository's configs/finetune/TASK.yaml: a task's own settings
TASK_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "finetune")


def task_config(task: str) -> str | None:
    """The task's own config, configs/finetune/TASK.yaml, when there is one."""
    path = os.path.join(TASK_CONFIGS, f"{task}.yaml")
    return path if os.path.exists(path) else None


def load_finetune_config(path: str | None, overrides: Sequence[str] = ()) -> FinetuneConfig:
    tree = load_sections(path, overrides, SECTIONS)
    return FinetuneConfig(**{name: cls(**tree.get(name, {})) for name, cls in SECTIONS.items()})
