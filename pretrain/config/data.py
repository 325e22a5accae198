"""The data section: corpora, sequence length, masking, segment pairs, packing and loaders, with the
rules about its own fields."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .checks import non_negative, one_of, positive
from .choices import DATA_KINDS, MASKING_MODES, SEGMENT_PAIRS


@dataclass
class DataConfig:
    kind: str = "synthetic"  # "synthetic" (no files; tests, demos) | "indexed" (preprocessed .bin/.idx)
    seq_length: int = 128
    # masked positions per sequence (padded to this); None: what the masking rate needs,
    # ceil(max(masked_lm_prob, eval_masked_lm_prob) x seq_length) (20 at seq 128 and 15%)
    max_predictions_per_seq: int | None = None
    masked_lm_prob: float = 0.15  # share of a sequence's tokens predicted in training
    eval_masked_lm_prob: float | None = None  # ... in evaluation (validation, test); None: masked_lm_prob
    # what a predicted token becomes: [MASK] with this probability, a random token with the next, else
    # itself (BERT's 80/10/10)
    mask_token_share: float = 0.8
    random_token_share: float = 0.1
    num_samples: int = 100000  # synthetic dataset size
    # synthetic samples are [min_fraction * seq_length, seq_length] tokens long (uniform); lower it for
    # the length spread of a real corpus (packing tests, benchmarks)
    synthetic_min_fraction: float = 0.5
    seed: int = 1234  # data generation / shuffling / masking seed
    # indexed data (kind: indexed)
    paths: list[str] = field(default_factory=list)  # dataset prefixes: <prefix>.bin/.idx from tools/preprocess_data.py
    weights: list[float] = field(default_factory=list)  # blending weights, one per path; empty = equal
    weights_unit: str = "samples"  # what data.weights are shares of: "samples" (Megatron's) or "tokens"
    # shares by the corpora's sizes in tokens instead of data.weights (pretrain/data/samples/mixture.py):
    # proportional to tokens^(1/T), or tokens^alpha as XLM-R and mmBERT state it (alpha = 1/T); one of them
    sampling_temperature: float | None = None
    sampling_alpha: float | None = None
    max_epochs: float | None = None  # refuse a blend that reads a corpus more often than this
    vocab_file: str | None = None  # vocab.txt or tokenizer.json the data was preprocessed with
    # train on datasets whose recorded vocabulary is not vocab_file's (a deliberate change; without
    # it such a dataset is refused before the run starts, naming both files)
    accept_dataset_vocab: bool = False
    split: str = "949,50,1"  # train,valid,test shares of each corpus's documents (Megatron's rule)
    # separate validation / test corpora (all their documents; Megatron's --valid-data-path and
    # --test-data-path): used instead of the split's valid / test shares of data.paths
    valid_paths: list[str] = field(default_factory=list)
    test_paths: list[str] = field(default_factory=list)
    segment_pairs: str = "nsp"  # "nsp" (BERT) | "sop" (ALBERT/Megatron sentence order) | "none" (one segment)
    short_seq_prob: float = 0.1  # share of samples cut to a random shorter target length
    whole_word_masking: bool = True  # mask a word's pieces together (WordPiece '##' continuations; BPE: Ġ/▁ word starts)
    max_ngram: int = 1  # 1 = BERT; n > 1 masks spans of up to n words, length drawn with p ~ 1/length
    masking: str = "static"  # "static" (a sample's masks fixed) | "dynamic" (redrawn every epoch)
    index_cache_dir: str | None = None  # where sample indices are cached; default <data dir>/index-cache
    num_workers: int = 2  # loader processes per rank preparing batches ahead of the trainer (0 = inline)
    # several samples share a row of seq_length tokens, each attending only to itself (block-diagonal
    # attention, its own positions from 0): a micro-batch's samples fill as few rows as they fit in.
    # The same samples per step, the same losses and gradients, fewer padding tokens computed
    packing: bool = False

    # [first sample, count] ranges of the training sample sequence never trained on (as PaLM skips
    # the batches around a loss spike): the run steps over them, its step count and LR schedule
    # unaffected. Whole global batches (multiples of train.global_batch_size). A spike rollback
    # adds its own ranges (resilience.spike_policy), kept in the run's checkpoints
    skip_samples: list[list[int]] = field(default_factory=list)

    def problems(self) -> list[str]:
        p: list[str] = []
        one_of(p, "data.kind", self.kind, DATA_KINDS)
        for entry in self.skip_samples:
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] >= 0 and entry[1] > 0):
                p.append(f"data.skip_samples entry {entry} must be [first sample >= 0, count > 0]")
        positive(p, "data.seq_length", self.seq_length)
        if not 0.0 < self.masked_lm_prob <= 1.0:
            p.append(f"data.masked_lm_prob ({self.masked_lm_prob}) must be in (0, 1]")
        if self.eval_masked_lm_prob is not None and not 0.0 < self.eval_masked_lm_prob <= 1.0:
            p.append(f"data.eval_masked_lm_prob ({self.eval_masked_lm_prob}) must be in (0, 1]")
        for name in ("mask_token_share", "random_token_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                p.append(f"data.{name} ({getattr(self, name)}) must be in [0, 1]")
        if self.mask_token_share + self.random_token_share > 1.0 + 1e-12:
            p.append(f"data.mask_token_share ({self.mask_token_share}) + data.random_token_share "
                     f"({self.random_token_share}) must be <= 1 (the rest keep their token)")
        if self.max_predictions_per_seq is not None:
            positive(p, "data.max_predictions_per_seq", self.max_predictions_per_seq)
            if self.max_predictions_per_seq > self.seq_length:
                p.append(f"data.max_predictions_per_seq ({self.max_predictions_per_seq}) must be <= "
                         f"data.seq_length ({self.seq_length})")
            elif 0.0 < self.highest_masking_rate() <= 1.0 and self.max_predictions_per_seq < round(
                    self.highest_masking_rate() * self.seq_length) - 3:
                p.append(f"data.max_predictions_per_seq ({self.max_predictions_per_seq}) caps the masking rate "
                         f"{self.highest_masking_rate():g} (about {round(self.highest_masking_rate() * self.seq_length)} "
                         f"positions at data.seq_length {self.seq_length}): raise it, or set data.max_predictions_per_seq=null "
                         "(on the command line, or in the config file that sets it) to follow the rate")
        positive(p, "data.num_samples", self.num_samples)
        if not 0.0 < self.synthetic_min_fraction <= 1.0:
            p.append(f"data.synthetic_min_fraction ({self.synthetic_min_fraction}) must be in (0, 1]")
        non_negative(p, "data.seed", self.seed)  # numpy seeds must be >= 0
        one_of(p, "data.segment_pairs", self.segment_pairs, SEGMENT_PAIRS)
        one_of(p, "data.masking", self.masking, MASKING_MODES)
        if not 0.0 <= self.short_seq_prob <= 1.0:
            p.append(f"data.short_seq_prob ({self.short_seq_prob}) must be in [0, 1]")
        positive(p, "data.max_ngram", self.max_ngram)
        non_negative(p, "data.num_workers", self.num_workers)
        if self.kind == "indexed":
            p += self._indexed_problems()
        else:  # random tokens would be trained on, the files never read
            named = [f"data.{name}" for name in ("paths", "valid_paths", "test_paths") if getattr(self, name)]
            if named:
                p.append(f"{' and '.join(named)} set, but data.kind is {self.kind} (random tokens; the default of "
                         "configs/pretrain-defaults.yaml and the configs built on it): set data.kind=indexed to "
                         "train on those files")
        return p

    def evaluation_masking_rate(self) -> float:
        return self.masked_lm_prob if self.eval_masked_lm_prob is None else self.eval_masked_lm_prob

    def highest_masking_rate(self) -> float:
        return max(self.masked_lm_prob, self.evaluation_masking_rate())

    def max_predictions(self) -> int:
        """Masked positions per sequence: data.max_predictions_per_seq, or what the higher of the two
        rates needs at data.seq_length (training and evaluation batches share one shape)."""
        if self.max_predictions_per_seq is not None:
            return self.max_predictions_per_seq
        return max(1, min(self.seq_length, math.ceil(self.highest_masking_rate() * self.seq_length - 1e-9)))

    def sampling_exponent(self) -> float | None:
        """alpha of the shares proportional to tokens^alpha; None: by data.weights."""
        if self.sampling_alpha is not None:
            return self.sampling_alpha
        return None if self.sampling_temperature is None else 1.0 / self.sampling_temperature

    def _indexed_problems(self) -> list[str]:
        p: list[str] = []
        if not self.paths:
            p.append("data.paths must list at least one dataset prefix when data.kind is indexed")
        if not self.vocab_file:
            p.append("data.vocab_file is required when data.kind is indexed")
        # a corpus-group manifest (tools/preprocess_data.py --group-by) stands for its datasets
        manifests = [path for path in self.paths if path.endswith(".groups.json")]
        if self.weights and manifests:
            p.append(f"data.paths: {manifests[0]} stands for one corpus per group: leave data.weights unset (shares "
                     "by size: data.sampling_alpha or data.sampling_temperature; unset: equal shares of samples)")
        elif self.weights and len(self.weights) != len(self.paths):
            p.append(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
        if any(not w > 0 for w in self.weights):
            p.append(f"data.weights ({self.weights}) must all be > 0")
        if self.weights_unit not in ("samples", "tokens"):
            p.append(f"data.weights_unit ({self.weights_unit!r}) must be samples or tokens")
        sampling = [f"data.{k}" for k in ("sampling_temperature", "sampling_alpha") if getattr(self, k) is not None]
        if len(sampling) == 2:
            p.append("data.sampling_temperature and data.sampling_alpha say the same (alpha = 1 / temperature): set one")
        if sampling and self.weights:
            p.append(f"{sampling[0]} sets each corpus's share from its size: leave data.weights unset")
        for key in ("sampling_temperature", "sampling_alpha", "max_epochs"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                p.append(f"data.{key} ({value}) must be > 0")
        try:
            shares = [float(x) for x in self.split.split(",")]
        except ValueError:
            shares = []
        if not 1 <= len(shares) <= 3 or min(shares) < 0 or sum(shares) <= 0:
            p.append(f"data.split ({self.split!r}) must be up to three comma-separated non-negative shares "
                     "with a positive sum, e.g. '949,50,1'")
        if self.segment_pairs != "none" and self.seq_length < 4:
            p.append(f"data.seq_length ({self.seq_length}) must be >= 4 for segment pairs")
        return p
