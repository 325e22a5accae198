"""Tests for pretrain.config: loading, overrides, validation rules, DeepSpeed JSON."""

import dataclasses
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pretrain.config import (
    PARAMETER_KINDS,
    Config,
    ConfigError,
    ModelConfig,
    build_deepspeed_config,
    load_config,
)
from pretrain.config.schema import MOVED_KEYS, SECTIONS

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
SHIPPED_YAML = sorted(CONFIGS.glob("*.yaml"))
SHIPPED_JSON = sorted((CONFIGS / "deepspeed").glob("*.json"))


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def problems_of(excinfo) -> list[str]:
    err = excinfo.value
    assert str(err) == "\n".join(err.problems)  # the message is the problems, one per line
    return err.problems


# --------------------------------------------------------------------------------------------
# Shipped configs
# --------------------------------------------------------------------------------------------


def test_all_expected_configs_are_shipped():
    names = {p.name for p in SHIPPED_YAML}
    assert {"pretrain-defaults.yaml", "bert-tiny.yaml", "bert-mini.yaml", "bert-small.yaml",
            "bert-medium.yaml", "bert-base.yaml", "bert-large.yaml"} <= names
    assert {f"bert-{size}-phase{n}.yaml" for size in ("base", "large") for n in (1, 2)} <= names
    assert {p.name for p in SHIPPED_JSON} >= {"zero0.json", "zero1.json", "zero2.json", "zero3.json", "bf16.json"}


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: p.name)
def test_shipped_yaml_loads_and_validates(path):
    cfg = load_config(str(path))
    if cfg.data.kind == "indexed":  # the phase configs leave the data to the command line
        with pytest.raises(ConfigError, match="data.paths must list.*\n.*data.vocab_file is required"):
            cfg.validate()
        # model.vocab_size null (the ModernBERT demo's): the tokenizer's size, read by python -m pretrain
        size = [] if cfg.model.vocab_size is not None else ["model.vocab_size=8000"]
        cfg = load_config(str(path), ["data.paths=[corpus_text_sentence]", "data.vocab_file=vocab.txt", *size])
    cfg.validate()
    model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel  # the demo's is TP2
    cfg.validate(world_size=model_parallel)
    cfg.validate(world_size=4 * model_parallel)
    assert cfg.grad_accum_steps(model_parallel) == cfg.train.global_batch_size // cfg.train.micro_batch_size


@pytest.mark.parametrize("name,layers,hidden,heads", [
    ("tiny", 2, 128, 2), ("mini", 4, 256, 4), ("small", 4, 512, 8),
    ("medium", 8, 512, 8), ("base", 12, 768, 12), ("large", 24, 1024, 16),
])
def test_model_sizes(name, layers, hidden, heads):
    cfg = load_config(str(CONFIGS / f"bert-{name}.yaml"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_size) == (layers, hidden, heads, 4 * hidden)
    # inherited from pretrain-defaults.yaml
    assert cfg.optimizer.name == "lamb" and cfg.scheduler.decay == "poly" and cfg.data.seq_length == 128


def test_demo_configs_override_only_what_they_set():
    defaults = load_config(str(CONFIGS / "pretrain-defaults.yaml"))
    tiny = load_config(str(CONFIGS / "bert-tiny.yaml"))
    assert tiny.train.global_batch_size < defaults.train.global_batch_size
    # deep merge: tiny sets optimizer.lr but keeps the rest of the inherited optimizer section
    assert tiny.optimizer.lr != defaults.optimizer.lr
    assert tiny.optimizer.weight_decay == defaults.optimizer.weight_decay == 0.01
    assert tiny.optimizer.clip() == 1.0


# --------------------------------------------------------------------------------------------
# Loading: base inheritance, overrides, key and type checks
# --------------------------------------------------------------------------------------------


def test_no_file_gives_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    cfg.validate(world_size=1)


def test_base_inheritance_and_deep_merge(tmp_path):
    write(tmp_path / "shared" / "root.yaml", "model: {hidden_size: 64, num_layers: 3}\ntrain: {seed: 1}\n")
    write(tmp_path / "shared" / "a.yaml",
          "base: root.yaml\nmodel: {num_layers: 4, num_attention_heads: 4}\noptimizer: {lr: 0.5}\n")
    write(tmp_path / "shared" / "b.yaml", "optimizer: {lr: 0.25, beta1: 0.8}\n")
    top = write(tmp_path / "exp" / "top.yaml",
                "base: [../shared/a.yaml, ../shared/b.yaml]\nmodel: {num_attention_heads: 8}\n")
    cfg = load_config(top)
    assert cfg.model.hidden_size == 64          # from root, two levels down
    assert cfg.model.num_layers == 4            # a over root
    assert cfg.model.num_attention_heads == 8   # top over a
    assert cfg.optimizer.lr == 0.25             # later base (b) over earlier (a)
    assert cfg.optimizer.beta1 == 0.8
    assert cfg.train.seed == 1
    assert cfg.train.global_batch_size == 256   # untouched default


def test_base_errors(tmp_path):
    missing = write(tmp_path / "m.yaml", "base: nope.yaml\n")
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(missing)
    write(tmp_path / "x.yaml", "base: y.yaml\n")
    cyc = write(tmp_path / "y.yaml", "base: x.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(cyc)
    bad = write(tmp_path / "bad.yaml", "model: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_config(bad)


def test_overrides(tmp_path):
    path = write(tmp_path / "c.yaml", "train: {precision: fp16}\ncheckpoint: {save_dir: /tmp/x}\n")
    cfg = load_config(path, [
        "train.precision=bf16",
        "checkpoint.save_dir=null",
        "optimizer.no_weight_decay=[bias]",
        "optimizer.no_layer_adaptation=[]",
        "model.recompute=selective",
        "logging.timers=true",
        "optimizer.lr=1e-3",          # YAML 1.1 would read this as a string
        "optimizer.weight_decay=0",   # int accepted for float
        "optimizer.max_trust_ratio=10.0",
        "model.hidden_size=128",
        "model.hidden_size=256",      # later wins
        "logging.tensorboard_dir=runs/a=b",  # only the first '=' splits
    ])
    assert cfg.train.precision == "bf16"
    assert cfg.checkpoint.save_dir is None
    assert cfg.optimizer.no_weight_decay == ["bias"]
    assert cfg.optimizer.no_layer_adaptation == []
    assert cfg.model.recompute == "selective" and cfg.logging.timers is True
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.optimizer.max_trust_ratio == 10.0
    assert cfg.model.hidden_size == 256
    assert cfg.logging.tensorboard_dir == "runs/a=b"


def test_unknown_key_in_yaml_names_file_key_and_valid_keys(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  hiden_size: 12\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    (line,) = problems_of(e)
    assert path in line and "model.hiden_size" in line and "hidden_size" in line.split("valid keys")[1]


def test_unknown_key_in_base_names_the_base_file(tmp_path):
    write(tmp_path / "base.yaml", "train: {batch: 4}\n")
    top = write(tmp_path / "top.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(top)
    (line,) = problems_of(e)
    assert str(tmp_path / "base.yaml") in line and "train.batch" in line


def test_unknown_section(tmp_path):
    path = write(tmp_path / "c.yaml", "modle: {hidden_size: 12}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    (line,) = problems_of(e)
    assert path in line and "'modle'" in line and "model, parallel, optimizer" in line


def test_unknown_keys_in_overrides_name_command_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.bogus=1", "nosection.x=2"])
    lines = problems_of(e)
    assert len(lines) == 2
    assert all(line.startswith("command line:") for line in lines)
    assert "train.bogus" in lines[0] and "global_batch_size" in lines[0]
    assert "'nosection'" in lines[1]


@pytest.mark.parametrize("override,suggestion", [
    ("model.ffn_size=8", "(did you mean 'model.ffn_hidden_size'?)"),  # the name the old shape message used
    ("train.vocab_file=v.txt", "(did you mean 'data.vocab_file'?)"),  # the right name in another section
    ("train.micro_batchsize=2", "(did you mean 'train.micro_batch_size'?)"),
    ("modl.hidden_size=8", "(did you mean 'model'?)"),
])
def test_unknown_key_says_did_you_mean(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    (line,) = problems_of(e)
    assert suggestion in line


def test_unknown_key_without_a_close_name_suggests_nothing():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.qqqq=1"])
    assert "did you mean" not in problems_of(e)[0]


@pytest.mark.parametrize("bad", ["train.precision", "precision=bf16", "a.b.c=1", ".x=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="command line: malformed override"):
        load_config(None, [bad])


@pytest.mark.parametrize("override,expected", [
    ("model.hidden_size='768'", "model.hidden_size must be int, got str '768'"),
    ("model.hidden_size=true", "model.hidden_size must be int, got bool True"),   # bool is not int
    ("model.hidden_size=7.5", "model.hidden_size must be int, got float 7.5"),
    ("model.hidden_size=null", "model.hidden_size must be int, got null"),
    ("optimizer.lr=fast", "optimizer.lr must be float, got str 'fast'"),
    ("optimizer.no_weight_decay=bias", "optimizer.no_weight_decay must be list[str], got str 'bias'"),
    ("optimizer.no_weight_decay=[1]", "optimizer.no_weight_decay must be list[str], got list [1]"),
    ("logging.timers=1", "logging.timers must be bool, got int 1"),
    ("checkpoint.save_dir=5", "checkpoint.save_dir must be str or null, got int 5"),
])
def test_wrong_type(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert problems_of(e) == [f"command line: {expected}"]


def test_several_type_errors_in_one_error(tmp_path):
    path = write(tmp_path / "c.yaml", "model: {num_layers: two}\ntrain: {micro_batch_size: 1.5}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["data.seq_length=long"])
    lines = problems_of(e)
    assert len(lines) == 3
    assert "model.num_layers" in lines[0] and "train.micro_batch_size" in lines[1]
    assert lines[2].startswith("command line: data.seq_length")


def test_section_must_be_mapping(tmp_path):
    path = write(tmp_path / "c.yaml", "model: 5\n")
    with pytest.raises(ConfigError, match="section 'model' must be a mapping"):
        load_config(path)


# --------------------------------------------------------------------------------------------
# Validation rules
# --------------------------------------------------------------------------------------------


def cfg_with(*overrides: str) -> Config:
    return load_config(None, overrides)


@pytest.mark.parametrize("overrides,expected", [
    (["model.hidden_size=100"], "model.hidden_size (100) must be divisible by model.num_attention_heads (12)"),
    (["parallel.tensor_parallel=8"], "model.num_attention_heads (12) must be divisible by parallel.tensor_parallel (8)"),
    (["parallel.tensor_parallel=4", "model.ffn_hidden_size=3070"], "ffn size (3070"),
    (["model.num_layers=3", "parallel.pipeline_parallel=2"],
     "model.num_layers (3) must be divisible by parallel.pipeline_parallel (2)"),
    (["parallel.zero_stage=2", "parallel.pipeline_parallel=2"],
     "parallel.zero_stage 2 cannot be combined with pipeline parallelism (pipeline_parallel=2); use zero_stage 0 or 1"),
    (["parallel.zero_stage=3", "parallel.pipeline_parallel=4"], "parallel.zero_stage 3 cannot be combined"),
    (["parallel.zero_stage=4"], "parallel.zero_stage (4) must be one of 0, 1, 2, 3"),
    (["parallel.tensor_parallel=0"], "parallel.tensor_parallel (0) must be >= 1"),
    (["optimizer.name=sgd"], "optimizer.name ('sgd') must be one of: lamb, adamw"),
    (["train.precision=fp8"], "train.precision ('fp8') must be one of: fp32, bf16, fp16"),
    (["data.kind=files"], "data.kind ('files') must be one of: synthetic, indexed"),
    (["data.segment_pairs=xyz"], "data.segment_pairs ('xyz') must be one of: nsp, sop, none"),
    (["data.masking=sometimes"], "data.masking ('sometimes') must be one of: static, dynamic"),
    (["data.short_seq_prob=1.5"], "data.short_seq_prob (1.5) must be in [0, 1]"),
    (["data.max_ngram=0"], "data.max_ngram (0) must be > 0"),
    (["data.valid_paths=[held]"], "data.valid_paths set, but data.kind is synthetic (random tokens"),
    # the files would never be read (the first-run guide trained on random tokens this way)
    (["data.paths=[books_text_sentence]", "data.vocab_file=v.txt"],
     "data.paths set, but data.kind is synthetic (random tokens; the default of configs/pretrain-defaults.yaml "
     "and the configs built on it): set data.kind=indexed to train on those files"),
    (["model.recompute=attention"], "model.recompute ('attention') must be one of: none, selective, full"),
    (["data.num_workers=-1"], "data.num_workers (-1) must be >= 0"),
    (["data.kind=indexed", "data.paths=[a]", "data.vocab_file=v.txt", "data.weights=[1,2]"],
     "data.weights has 2 entries for 1 data.paths"),
    (["data.kind=indexed", "data.paths=[a]", "data.vocab_file=v.txt", "data.weights=[0]"],
     "data.weights ([0.0]) must all be > 0"),
    (["data.kind=indexed", "data.paths=[a]", "data.vocab_file=v.txt", "data.split=9,x"],
     "data.split ('9,x') must be up to three comma-separated non-negative shares with a positive sum, e.g. '949,50,1'"),
    (["model.vocab_size=0"], "model.vocab_size (0) must be > 0"),
    (["train.micro_batch_size=0"], "train.micro_batch_size (0) must be > 0"),
    (["optimizer.lr=0"], "optimizer.lr (0.0) must be > 0"),
    (["optimizer.beta2=1"], "optimizer.beta2 (1.0) must be in [0, 1)"),
    (["optimizer.grad_clip=-1"], "optimizer.grad_clip (-1.0) must be >= 0"),
    (["optimizer.max_trust_ratio=0"], "optimizer.max_trust_ratio (0.0) must be > 0"),
    (["model.hidden_dropout=1.0"], "model.hidden_dropout (1.0) must be in [0, 1)"),
    (["model.attention_dropout=-0.1"], "model.attention_dropout (-0.1) must be in [0, 1)"),
    (["data.masked_lm_prob=0"], "data.masked_lm_prob (0.0) must be in (0, 1]"),
    (["data.masked_lm_prob=1.5"], "data.masked_lm_prob (1.5) must be in (0, 1]"),
    (["scheduler.warmup_steps=2000"], "scheduler.warmup_steps (2000) must be <= train.train_steps (1000)"),
    (["fp16.loss_scale=-1"], "fp16.loss_scale (-1.0) must be >= 0"),
    (["fp16.initial_scale_power=65"], "fp16.initial_scale_power (65) must be in [0, 64]"),
    (["fp16.loss_scale_window=0"], "fp16.loss_scale_window (0) must be > 0"),
    (["fp16.hysteresis=0"], "fp16.hysteresis (0) must be > 0"),
    (["fp16.min_loss_scale=0"], "fp16.min_loss_scale (0) must be > 0"),
    (["fp16.initial_scale_power=2", "fp16.min_loss_scale=8"], "fp16.min_loss_scale (8) must be <= 2 ** "
                                                              "fp16.initial_scale_power (4)"),
    (["scheduler.min_lr=0.1"], "scheduler.min_lr (0.1) must be <= optimizer.lr (0.001)"),
    (["scheduler.warmup_fraction=1.5"], "scheduler.warmup_fraction (1.5) must be in [0, 1]"),
    (["scheduler.warmup_fraction=0.1", "scheduler.warmup_steps=5"],
     "scheduler.warmup_steps (5) and scheduler.warmup_fraction (0.1) both set: give one"),
    (["scheduler.decay_steps=0"], "scheduler.decay_steps (0) must be > 0"),
    (["scheduler.decay_steps=50", "scheduler.warmup_steps=50", "scheduler.decay=cosine"],
     "scheduler.decay_steps (50) must exceed scheduler.warmup_steps (50) for scheduler.decay cosine"),
    (["scheduler.warmup_fraction=1.0", "scheduler.decay_steps=2000"],
     "scheduler.warmup_fraction x scheduler.decay_steps (2000) must be <= train.train_steps (1000)"),
    (["scheduler.warmup_tokens=100", "scheduler.decay_steps=50"],
     "scheduler: scheduler.decay_steps with token-counted lengths (scheduler.*_tokens): give every length in one unit"),
    (["scheduler.decay_start_steps=5", "scheduler.warmup_steps=10"],
     "scheduler.decay_start_steps (5) must be >= scheduler.warmup_steps (10)"),
    (["scheduler.decay_tokens=1000", "scheduler.decay_start_tokens=1000"],
     "scheduler.decay_tokens (1000) must exceed scheduler.decay_start_tokens (1000) for scheduler.decay linear"),
    (["train.batch_warmup_tokens=1000"],
     "train.batch_warmup_tokens needs train.batch_warmup_min_size (the first batch, and the ramp's step)"),
    (["train.batch_warmup_tokens=1000", "train.batch_warmup_min_size=512"],
     "train.batch_warmup_min_size (512) must be in (0, train.global_batch_size (256))"),
    (["scheduler.decay=exponential"], "scheduler.decay ('exponential') must be one of: linear, poly, cosine, "
                                      "1-sqrt, inverse_sqrt, constant"),
    (["data.seq_length=1024"], "data.seq_length (1024) must be <= model.max_position_embeddings (512)"),
    (["data.seq_length=16", "data.max_predictions_per_seq=20"],
     "data.max_predictions_per_seq (20) must be <= data.seq_length (16)"),
    (["data.seq_length=1024", "model.max_position_embeddings=1024", "data.masked_lm_prob=0.3",
      "data.max_predictions_per_seq=160"],
     "data.max_predictions_per_seq (160) caps the masking rate 0.3 (about 307 positions at data.seq_length 1024): "
     "raise it, or set data.max_predictions_per_seq=null (on the command line, or in the config file that sets it) "
     "to follow the rate"),
    (["data.eval_masked_lm_prob=0"], "data.eval_masked_lm_prob (0.0) must be in (0, 1]"),
    (["data.mask_token_share=0.9", "data.random_token_share=0.2"],
     "data.mask_token_share (0.9) + data.random_token_share (0.2) must be <= 1 (the rest keep their token)"),
    (["optimizer.no_weight_decay=[bias, norm]"], "optimizer.no_weight_decay entry 'norm' is not a parameter kind"),
    (["optimizer.no_layer_adaptation=[LayerNorm]"], "optimizer.no_layer_adaptation entry 'LayerNorm'"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last (-1) must be >= 0"),
    (["resilience.exit_duration_minutes=230"], "resilience.exit_duration_minutes (230) needs checkpoint.save_dir"),
    (["resilience.exit_duration_minutes=-1", "checkpoint.save_dir=ckpt"], "resilience.exit_duration_minutes (-1.0) must be >= 0"),
    (["resilience.max_consecutive_skips=0"], "resilience.max_consecutive_skips (0) must be > 0"),
    (["resilience.dist_timeout_minutes=0"], "resilience.dist_timeout_minutes (0.0) must be > 0"),
    (["train.global_batch_size=100"], "train.global_batch_size (100) must be a multiple of train.micro_batch_size (8)"),
])
def test_each_rule_produces_its_line(overrides, expected):
    cfg = cfg_with(*overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    lines = problems_of(e)
    assert len(lines) == 1, lines  # exactly the targeted rule fires
    assert expected in lines[0]


def test_fp16_with_lamb_and_zero_with_pp_stage1_are_allowed():
    cfg_with("train.precision=fp16", "optimizer.name=lamb", "parallel.zero_stage=1").validate(world_size=1)
    cfg_with("parallel.zero_stage=1", "parallel.pipeline_parallel=2", "model.num_layers=12").validate(world_size=2)
    cfg_with(*[f"optimizer.no_weight_decay=[{', '.join(PARAMETER_KINDS)}]"]).validate()


def test_several_violations_in_one_error():
    cfg = cfg_with("model.hidden_size=100", "optimizer.name=sgd", "train.precision=fp8",
                   "scheduler.warmup_steps=5000")
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    lines = problems_of(e)
    assert len(lines) == 4
    assert any(line.startswith("model.hidden_size (100)") for line in lines)
    assert any(line.startswith("optimizer.name") for line in lines)
    assert any(line.startswith("train.precision") for line in lines)
    assert any(line.startswith("scheduler.warmup_steps") for line in lines)


def test_batch_arithmetic():
    cfg = cfg_with("train.global_batch_size=256", "train.micro_batch_size=8", "parallel.tensor_parallel=2")
    assert cfg.data_parallel_size(8) == 4
    assert cfg.grad_accum_steps(8) == 8   # 256 = 8 x 8 x 4
    assert cfg.grad_accum_steps(2) == 32  # dp 1
    cfg.validate(world_size=8)

    bad = cfg_with("train.global_batch_size=96", "train.micro_batch_size=8")
    bad.validate(world_size=4)            # 96 = 8 x 3 x 4
    with pytest.raises(ConfigError) as e:
        bad.validate(world_size=8)        # 96 is not a multiple of 8 x 8
    (line,) = problems_of(e)
    assert "train.global_batch_size (96)" in line and "micro_batch_size (8)" in line and "data_parallel (8)" in line
    with pytest.raises(ConfigError, match=r"global_batch_size \(96\)"):
        bad.grad_accum_steps(8)


def test_world_size_must_fit_tp_times_pp():
    cfg = cfg_with("parallel.tensor_parallel=2", "parallel.pipeline_parallel=2")
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=6)
    (line,) = problems_of(e)
    assert "world size (6)" in line and "2 x 2 = 4" in line
    with pytest.raises(ConfigError, match=r"world size \(6\)"):
        cfg.data_parallel_size(6)


def test_padded_vocab_and_ffn_size():
    m = ModelConfig()
    assert m.padded_vocab_size(1) == 30592
    assert m.padded_vocab_size(2) == 30720
    assert ModelConfig(vocab_size=256).padded_vocab_size(2) == 256
    assert m.ffn_size == 3072
    assert ModelConfig(hidden_size=64, ffn_hidden_size=100).ffn_size == 100


# --------------------------------------------------------------------------------------------
# Serialisation
# --------------------------------------------------------------------------------------------


def test_a_key_that_moved_out_of_train_is_refused_naming_its_new_place(tmp_path):
    """No silent alias: in a file and on the command line, every moved key is one line of the report."""
    path = write(tmp_path / "old.yaml", "train:\n  train_steps: 5\n  save_dir: /ckpt\n  log_interval: 2\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, ["train.eval_interval=10", "train.max_consecutive_skips=3"])
    assert error.value.problems == [
        f"{path}: train.save_dir has moved: it is checkpoint.save_dir now",
        f"{path}: train.log_interval has moved: it is logging.interval now",
        "command line: train.eval_interval has moved: it is eval.interval now",
        "command line: train.max_consecutive_skips has moved: it is resilience.max_consecutive_skips now"]
    for old, new in MOVED_KEYS.items():  # every new place exists
        section, key = new.split(".")
        assert key in {f.name for f in dataclasses.fields(SECTIONS[section])}, new


def test_a_config_stored_before_the_keys_moved_still_loads():
    """Checkpoints written before the sections mirrored the trainer's parts keep their meaning."""
    stored = load_config(str(CONFIGS / "bert-tiny.yaml"), ["checkpoint.save_dir=/ckpt", "eval.interval=7",
                                                           "resilience.exit_after_steps=3"]).to_dict()
    old = {section: dict(entries) for section, entries in stored.items() if section in ("model", "data", "train")}
    old["train"].update(save_dir="/ckpt", eval_interval=7, exit_after_steps=3, log_interval=10)
    cfg = Config.from_stored(old)
    assert (cfg.checkpoint.save_dir, cfg.eval.interval, cfg.resilience.exit_after_steps) == ("/ckpt", 7, 3)
    with pytest.raises(ConfigError, match="train.save_dir has moved"):
        Config.from_dict(old)  # a user's dict is not migrated silently


def test_to_dict_from_dict_round_trip():
    cfg = load_config(str(CONFIGS / "bert-tiny.yaml"), ["checkpoint.save_dir=/ckpt", "optimizer.max_trust_ratio=10"])
    d = cfg.to_dict()
    assert d["model"]["hidden_size"] == 128 and d["checkpoint"]["save_dir"] == "/ckpt"
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert Config.from_dict(json.loads(json.dumps(d))) == cfg
    d["model"]["hidden_size"] = 64  # the dict is a copy
    assert cfg.model.hidden_size == 128


def test_from_dict_checks_keys_and_types():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"model": {"hidden_size": "big", "colour": 1}}, source="checkpoint ckpt/step10")
    lines = problems_of(e)
    assert len(lines) == 2
    assert all(line.startswith("checkpoint ckpt/step10:") for line in lines)


# --------------------------------------------------------------------------------------------
# DeepSpeed config
# --------------------------------------------------------------------------------------------


def test_build_deepspeed_config_values():
    cfg = cfg_with("train.global_batch_size=64", "train.micro_batch_size=4", "parallel.zero_stage=2",
                   "optimizer.grad_clip=0.5", "train.precision=bf16")
    ds = build_deepspeed_config(cfg, world_size=4)
    assert ds["train_batch_size"] == 64
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"] == {"enabled": True}
    assert ds["fp16"]["enabled"] is False
    assert ds["zero_allow_untested_optimizer"] is True
    assert ds["steps_per_print"] >= 10**9
    assert ds["wall_clock_breakdown"] is False
    assert "optimizer" not in ds and "scheduler" not in ds

    fp16 = build_deepspeed_config(cfg_with("train.precision=fp16"), world_size=1)
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1}
    assert fp16["bf16"] == {"enabled": False}
    assert fp16["gradient_accumulation_steps"] == 32

    with pytest.raises(ConfigError, match="global_batch_size"):
        build_deepspeed_config(cfg, world_size=32)


FP16_OPTIONS = ["train.precision=fp16", "fp16.initial_scale_power=12", "fp16.loss_scale_window=50",
                "fp16.hysteresis=3", "fp16.min_loss_scale=4"]


def test_fp16_loss_scaling_reaches_deepspeed():
    """Our fp16 keys, parsed by DeepSpeed's own config class: a misspelt key would leave its default."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import DeepSpeedConfig

    ds = build_deepspeed_config(cfg_with(*FP16_OPTIONS), world_size=1)
    single = SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0,
                             get_model_parallel_world_size=lambda: 1, get_model_parallel_rank=lambda: 0)
    parsed = DeepSpeedConfig(ds, mpu=single).float16_config
    assert parsed.enabled and parsed.loss_scale == 0
    assert parsed.initial_dynamic_scale() == 2**12
    assert (parsed.loss_scale_window, parsed.hysteresis, parsed.min_loss_scale) == (50, 3, 4)
    static = build_deepspeed_config(cfg_with("train.precision=fp16", "fp16.loss_scale=128"), world_size=1)
    assert DeepSpeedConfig(static, mpu=single).float16_config.loss_scale == 128
    # with another precision the fp16 block stays disabled and carries none of them
    assert build_deepspeed_config(cfg_with("fp16.hysteresis=3"), world_size=1)["fp16"] == {"enabled": False}


def test_user_json_may_not_contradict_the_fp16_keys(tmp_path):
    agrees = write(tmp_path / "same.json", json.dumps({"fp16": {"enabled": True, "hysteresis": 3,
                                                                "consecutive_hysteresis": True}}))
    ds = build_deepspeed_config(cfg_with(*FP16_OPTIONS, f"train.deepspeed_config={agrees}"), world_size=1)
    assert ds["fp16"]["consecutive_hysteresis"] is True and ds["fp16"]["hysteresis"] == 3
    user = write(tmp_path / "ds.json", json.dumps({"fp16": {"initial_scale_power": 32, "loss_scale_window": 50}}))
    with pytest.raises(ConfigError) as e:
        build_deepspeed_config(cfg_with(*FP16_OPTIONS, f"train.deepspeed_config={user}"), world_size=1)
    assert problems_of(e) == [f"{user}: fp16.initial_scale_power=32 contradicts fp16.initial_scale_power=12; "
                              "set fp16.initial_scale_power instead"]
    # fp16 options in a user JSON of a bf16 run are DeepSpeed's business (its fp16 block is off)
    build_deepspeed_config(cfg_with("train.precision=bf16", f"train.deepspeed_config={user}"), world_size=1)


def test_user_json_extra_keys_merged(tmp_path):
    user = write(tmp_path / "ds.json", json.dumps({
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False, "immediate_grad_update": True},
        "flops_profiler": {"enabled": True},
        "train_batch_size": 256,          # equal to ours: fine
        "gradient_clipping": 1,           # 1 == 1.0: fine
        "wall_clock_breakdown": True,     # DeepSpeed-only diagnostic: the user may turn it on
    }))
    cfg = cfg_with("parallel.zero_stage=3", f"train.deepspeed_config={user}")
    ds = build_deepspeed_config(cfg, world_size=1)
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0}
    assert ds["bf16"] == {"enabled": False, "immediate_grad_update": True}
    assert ds["flops_profiler"] == {"enabled": True}
    assert ds["train_batch_size"] == 256 and ds["gradient_accumulation_steps"] == 32
    assert ds["wall_clock_breakdown"] is True


def test_user_json_contradiction_names_file_and_key():
    zero3 = os.path.relpath(CONFIGS / "deepspeed" / "zero3.json")
    cfg = cfg_with("parallel.zero_stage=1", f"train.deepspeed_config={zero3}")
    with pytest.raises(ConfigError) as e:
        build_deepspeed_config(cfg, world_size=1)
    assert problems_of(e) == [
        f"{zero3}: zero_optimization.stage=3 contradicts parallel.zero_stage=1; set parallel.zero_stage instead"]


def test_user_json_several_contradictions(tmp_path):
    user = write(tmp_path / "ds.json", json.dumps({
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "fp16": {"enabled": 1},
        "zero_allow_untested_optimizer": False,
    }))
    with pytest.raises(ConfigError) as e:
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={user}"), world_size=1)
    lines = problems_of(e)
    assert len(lines) == 6
    assert all(line.startswith(f"{user}: ") for line in lines)
    assert "train_micro_batch_size_per_gpu=16 contradicts train.micro_batch_size=8" in lines[0]
    assert "gradient_accumulation_steps=2 contradicts 32" in lines[1]
    assert "gradient_clipping=0.0 contradicts optimizer.grad_clip=1.0; set optimizer.grad_clip instead" in lines[2]
    assert "bf16.enabled=true contradicts train.precision=fp32; set train.precision instead" in lines[3]
    assert "fp16.enabled=1 contradicts train.precision=fp32" in lines[4]   # 1 is not false
    assert "zero_allow_untested_optimizer=false" in lines[5] and "remove it" in lines[5]


def test_shipped_bf16_json_needs_bf16_precision():
    bf16 = str(CONFIGS / "deepspeed" / "bf16.json")
    ok = build_deepspeed_config(cfg_with("train.precision=bf16", f"train.deepspeed_config={bf16}"), 1)
    assert ok["bf16"]["enabled"] is True
    with pytest.raises(ConfigError, match="bf16.enabled=true contradicts train.precision=fp32"):
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={bf16}"), 1)


@pytest.mark.parametrize("block,hint", [("optimizer", "optimizer.*"), ("scheduler", "scheduler.*")])
def test_user_json_optimizer_and_scheduler_blocks_refused(tmp_path, block, hint):
    user = write(tmp_path / "ds.json", json.dumps({block: {"type": "Lamb", "params": {}}}))
    with pytest.raises(ConfigError) as e:
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={user}"), world_size=1)
    (line,) = problems_of(e)
    assert line.startswith(f"{user}: '{block}' block not allowed")
    assert "configured in our config, not in DeepSpeed JSON" in line and hint in line


def test_user_json_file_errors_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=f"file not found: {missing}"):
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={missing}"), world_size=1)
    broken = write(tmp_path / "broken.json", '{"zero_optimization": {"stage": 1,}}')
    with pytest.raises(ConfigError, match=f"{broken}: invalid JSON"):
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={broken}"), world_size=1)
    not_obj = write(tmp_path / "list.json", "[1]")
    with pytest.raises(ConfigError, match=f"{not_obj}: top level must be a JSON object"):
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={not_obj}"), world_size=1)
    wrong_shape = write(tmp_path / "shape.json", '{"zero_optimization": 2}')
    with pytest.raises(ConfigError, match=f"{wrong_shape}: 'zero_optimization' must be a JSON object"):
        build_deepspeed_config(cfg_with(f"train.deepspeed_config={wrong_shape}"), world_size=1)


@pytest.mark.parametrize("path", SHIPPED_JSON, ids=lambda p: p.name)
def test_shipped_json_matches_its_name(path):
    user = json.loads(path.read_text())
    assert "optimizer" not in user and "scheduler" not in user
    if path.stem.startswith("zero"):
        assert user["zero_optimization"]["stage"] == int(path.stem[-1])
    if path.stem == "bf16":
        assert user["bf16"]["enabled"] is True


def test_shipped_json_accepted_by_deepspeed():
    """Every key in the shipped JSONs exists in the installed DeepSpeed's schema:
    its zero/bf16 sections forbid unknown keys; top-level keys must be DeepSpeed constants."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.constants as ds_constants
    from deepspeed.runtime.config import DeepSpeedConfig

    known_top = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)}
    known_top |= {"zero_optimization"}
    for path in SHIPPED_JSON:
        stage = int(path.stem[-1]) if path.stem.startswith("zero") else 0
        precision = "bf16" if path.stem == "bf16" else "fp32"
        cfg = cfg_with(f"parallel.zero_stage={stage}", f"train.precision={precision}",
                       f"train.deepspeed_config={path}", "train.global_batch_size=64")
        ds = build_deepspeed_config(cfg, world_size=1)
        assert set(ds) <= known_top, (path.name, set(ds) - known_top)
        parsed = DeepSpeedConfig(ds)  # raises on unknown zero_optimization / bf16 keys
        assert parsed.zero_optimization_stage == stage
        assert parsed.train_batch_size == 64 and parsed.gradient_accumulation_steps == 8


# --------------------------------------------------------------------------------------------
# precision x ZeRO rules and bf16's gradient dtype
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,expected", [
    (["train.precision=bf16"],
     "train.precision bf16 at parallel.zero_stage 0: DeepSpeed accumulates and reduces bf16 gradients in fp32 "
     "(train.grad_accum_dtype fp32, the default) only in its ZeRO optimizers; set parallel.zero_stage=1 (the weights "
     "and gradients of ZeRO-0, the optimizer state partitioned over data-parallel ranks) or train.grad_accum_dtype=bf16"),
    (["train.grad_accum_dtype=bf16"],
     "train.grad_accum_dtype bf16 is for train.precision bf16 (this run is fp32: fp32 gradients are fp32, fp16's are "
     "DeepSpeed's loss-scaled fp16)"),
    (["train.precision=bf16", "parallel.zero_stage=1", "train.grad_accum_dtype=fp64"],
     "train.grad_accum_dtype ('fp64') must be one of: fp32, bf16"),
    (["train.precision=fp16"],
     "train.precision fp16 at parallel.zero_stage 0: DeepSpeed 0.19's fp16 ZeRO-0 optimizer divides the gradients by "
     "the loss scale although its engine never scaled the loss, so every update would see the gradient divided by "
     "2**fp16.initial_scale_power; set parallel.zero_stage=1 (the weights and gradients of ZeRO-0, the optimizer "
     "state partitioned over data-parallel ranks)"),
    (["train.precision=bf16", "train.grad_accum_dtype=bf16", "parallel.pipeline_parallel=2", "model.num_layers=2"],
     "train.precision bf16 with pipeline parallelism (2 stages) at parallel.zero_stage 0: DeepSpeed's bf16 pipeline "
     "optimizer cannot resume its own ZeRO-0 checkpoints; set parallel.zero_stage=1 (the same memory at one "
     "data-parallel rank, less at more)"),
])
def test_precision_combinations_deepspeed_cannot_run_are_named(overrides, expected):
    with pytest.raises(ConfigError) as e:
        cfg_with(*overrides).validate(world_size=2)
    assert problems_of(e) == [expected]


@pytest.mark.parametrize("overrides", [
    ["train.precision=bf16", "parallel.zero_stage=1"], ["train.precision=bf16", "parallel.zero_stage=3"],
    ["train.precision=bf16", "train.grad_accum_dtype=bf16"], ["train.precision=fp16", "parallel.zero_stage=1"],
    ["train.precision=bf16", "parallel.zero_stage=1", "parallel.pipeline_parallel=2", "model.num_layers=2"],
])
def test_precision_combinations_that_run(overrides):
    cfg_with(*overrides).validate(world_size=2)


def test_bf16_gradient_dtype_reaches_deepspeed(tmp_path):
    """fp32 accumulation and reduction for bf16 by default, parsed by DeepSpeed's own config class;
    fp32 and fp16 runs leave DeepSpeed's defaults; a user JSON may not contradict them."""
    from deepspeed.runtime.config import DeepSpeedConfig

    single = SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0,
                             get_model_parallel_world_size=lambda: 1, get_model_parallel_rank=lambda: 0)
    for dtype in ("fp32", "bf16"):
        ds = build_deepspeed_config(cfg_with("train.precision=bf16", "parallel.zero_stage=1",
                                             f"train.grad_accum_dtype={dtype}"), world_size=1)
        parsed = DeepSpeedConfig(ds, mpu=single)
        assert (parsed.grad_accum_dtype, str(parsed.communication_data_type)) == \
            (dtype, {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype])
    for precision in ("fp32", "fp16"):
        ds = build_deepspeed_config(cfg_with(f"train.precision={precision}"), world_size=1)
        assert "data_types" not in ds and "communication_data_type" not in ds
    user = write(tmp_path / "ds.json", json.dumps({"communication_data_type": "bf16"}))
    with pytest.raises(ConfigError) as e:
        build_deepspeed_config(cfg_with("train.precision=bf16", "parallel.zero_stage=1",
                                        f"train.deepspeed_config={user}"), world_size=1)
    assert problems_of(e) == [f'{user}: communication_data_type="bf16" contradicts train.grad_accum_dtype=fp32; '
                              "set train.grad_accum_dtype instead"]


def test_the_batch_warmup_minimum_is_whole_micro_batches_on_every_rank():
    cfg = cfg_with("train.batch_warmup_tokens=100000", "train.batch_warmup_min_size=24", "train.global_batch_size=48")
    cfg.validate(world_size=3)  # 8 x 3 = 24
    with pytest.raises(ConfigError, match=r"train.batch_warmup_min_size \(24\) must be a multiple of "
                                          r"train.micro_batch_size x data parallel \(8 x 2\)"):
        cfg.validate(world_size=2)


# --------------------------------------------------------------------------------------------
# optimizer.grad_clip's default and the stable_adamw-only keys
# --------------------------------------------------------------------------------------------


def test_grad_clip_default_follows_the_optimizer():
    """Unset, clipping is off with stable_adamw (its update clipping stands in for it) and 1.0
    otherwise; a set value wins either way, and DeepSpeed gets the resolved one."""
    assert cfg_with("optimizer.name=lamb").optimizer.clip() == 1.0
    assert cfg_with("optimizer.name=adamw").optimizer.clip() == 1.0
    stable = cfg_with("optimizer.name=stable_adamw")
    assert stable.optimizer.grad_clip is None and stable.optimizer.clip() == 0.0
    assert build_deepspeed_config(stable, world_size=1)["gradient_clipping"] == 0.0
    assert cfg_with("optimizer.name=stable_adamw", "optimizer.grad_clip=0.5").optimizer.clip() == 0.5
    assert cfg_with("optimizer.name=lamb", "optimizer.grad_clip=0").optimizer.clip() == 0.0
    # the start-up line says so (it said "clipped by DeepSpeed" for StableAdamW, whose clipping is off)
    assert stable.optimizer.clipping_words() == "not clipped (optimizer.grad_clip 0: StableAdamW bounds each update itself)"
    assert cfg_with("optimizer.name=lamb").optimizer.clipping_words() == "clipped at norm 1"
    assert cfg_with("optimizer.name=adamw", "optimizer.grad_clip=0").optimizer.clipping_words() == \
        "not clipped (optimizer.grad_clip 0)"


@pytest.mark.parametrize("key", ["optimizer.decouple_lr=true", "optimizer.max_lr=0.01", "optimizer.kahan_sum=true"])
def test_stable_adamw_keys_refused_with_other_optimizers(key):
    name = key.split("=")[0]
    assert cfg_with(key).optimizer.problems() == [f"{name} applies to optimizer.name=stable_adamw only, not lamb; remove it"]
    assert cfg_with("optimizer.name=stable_adamw", key).optimizer.problems() == []
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        cfg_with("optimizer.name=adamw", key).validate(world_size=1)


RECIPES = sorted((CONFIGS / "recipes").glob("*.yaml"))


def recipe(name: str, *overrides):
    data = ["data.paths=[corpus_text_sentence]", "data.vocab_file=tokenizer.json"]
    if "tiny" in name:  # its model.vocab_size is null: the tokenizer's size, read by python -m pretrain
        data.append("model.vocab_size=8000")
    return load_config(str(CONFIGS / "recipes" / name), data + (["checkpoint.init_from=ckpt"] if "phase1" not in name else [])
                       + list(overrides))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_phases_load_and_validate(path):
    cfg = recipe(path.name)
    cfg.validate(world_size=1 if "tiny" in path.name else 16)  # the batch warmup's minimum: whole micro-batches on 16 ranks
    assert cfg.optimizer.name == "stable_adamw" and cfg.optimizer.clip() == 0.0  # StableAdamW clips its own updates
    assert cfg.checkpoint.new_phase == ("phase1" not in path.name)


@pytest.mark.parametrize("size,peak,ramp", [("base", 8e-4, 50e9), ("large", 5e-4, 10e9)])
def test_the_modernbert_recipe_holds_the_published_settings(size, peak, ramp):
    """The values docs/modernbert.md's table gives (the paper as issue 41 quotes it)."""
    one, two, three = (recipe(f"modernbert-{size}-phase{n}.yaml") for n in (1, 2, 3))
    o = one.optimizer
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.decouple_lr) == (peak, 0.9, 0.98, 1e-6, 1e-5, True)
    assert set(o.no_weight_decay) == {"bias", "layernorm"}
    assert (one.data.seq_length, one.data.masked_lm_prob, one.data.evaluation_masking_rate()) == (1024, 0.3, 0.15)
    assert one.model.global_rope_theta == one.model.local_rope_theta == 10000.0
    assert (one.scheduler.warmup_tokens, one.scheduler.decay) == (3_000_000_000, "constant")
    assert (one.train.global_batch_size, one.train.batch_warmup_tokens) == (4608, ramp)
    assert (one.train.precision, one.data.packing) == ("bf16", True)
    assert (two.data.seq_length, two.model.max_position_embeddings, two.optimizer.lr) == (8192, 8192, 3e-4)
    assert (two.model.global_rope_theta, two.model.local_rope_theta, two.optimizer.max_lr) == (160000.0, 10000.0, peak)
    assert two.train.global_batch_size * 8192 == 4608 * 1024 and two.scheduler.decay == "constant"
    assert (three.scheduler.decay, three.scheduler.min_lr, three.scheduler.warmup_tokens) == ("1-sqrt", 3e-7, 0)
    assert three.scheduler.min_lr == pytest.approx(0.001 * two.optimizer.lr)


def test_the_context_extension_recipe_stretches_the_global_layers_to_32k():
    """configs/recipes/modernbert-base-context-32k.yaml (docs/long-context.md): 32k rows, YaRN on the
    global layers only over the trained 8,192, CP4, the phases' 4.7M tokens a step."""
    cfg = recipe("modernbert-base-context-32k.yaml")
    m = cfg.model
    assert (cfg.data.seq_length, m.max_position_embeddings, cfg.parallel.context_parallel) == (32768, 32768, 4)
    assert m.rope_scaling_of(True) == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert m.rope_scaling_of(False) is None and m.global_rope_theta == 160000.0
    assert cfg.train.global_batch_size * 32768 == 4608 * 1024
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel x parallel.pipeline_parallel x "
                                          r"parallel.context_parallel \(1 x 1 x 4 = 4\)"):
        cfg.validate(world_size=6)


def test_ring_attention_is_modernberts_without_attention_dropout():
    """parallel.context_attention: ring passes ModernBERT's global keys around the CP group; BERT,
    attention dropout and an unknown value are each one line naming the key."""
    load_config(str(CONFIGS / "modernbert-tiny.yaml"), ["parallel.context_attention=ring"]).validate()
    for overrides, wanted in (([], "parallel.context_attention ring is ModernBERT's"),
                              (["model.architecture=modernbert", "model.attention_dropout=0.1",
                                "data.segment_pairs=none"], "model.attention_dropout 0 (not modernbert, 0.1)")):
        with pytest.raises(ConfigError, match=re.escape(wanted)):
            load_config(str(CONFIGS / "bert-tiny.yaml"), ["parallel.context_attention=ring", *overrides]).validate()
    with pytest.raises(ConfigError, match=r"parallel.context_attention \('rings'\) must be one of allgather, ring"):
        load_config(str(CONFIGS / "modernbert-tiny.yaml"), ["parallel.context_attention=rings"]).validate()


def test_the_multilingual_recipe_lowers_the_sampling_exponent_phase_by_phase():
    """configs/recipes/multilingual-base-phase*.yaml: ModernBERT-base's phases with mmBERT's
    sampling exponents 0.7, 0.5, 0.3 over the languages' sizes in tokens."""
    for phase, alpha in ((1, 0.7), (2, 0.5), (3, 0.3)):
        cfg = recipe(f"multilingual-base-phase{phase}.yaml", "data.paths=[en,fr,sw]")
        base = recipe(f"modernbert-base-phase{phase}.yaml", "data.paths=[en,fr,sw]")
        assert cfg.data.sampling_exponent() == alpha and base.data.sampling_exponent() is None
        assert (cfg.data.seq_length, cfg.train.train_steps) == (base.data.seq_length, base.train.train_steps)
