"""Tokenized inputs kept between fine-tuning runs (task.cache_dir, finetune/input_cache.py): a later
run with the same file, tokenizer and task settings loads what the first one tokenized, equal to a
fresh tokenization; any change to those tokenizes again; a damaged entry is made again."""
import logging
from types import SimpleNamespace

import torch

from finetune.config import load_finetune_config
from finetune.finetuner import Finetuner
from finetune.tasks import TASKS
from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer
from test_finetune_tasks import repeat_task, tiny_bert

FEATURES = ("input_ids", "token_type_ids", "attention_mask", "labels")


def test_later_runs_load_the_tokenized_inputs_and_changes_tokenize_again(tmp_path, caplog):
    hf = tiny_bert(tmp_path)
    tokenizer = checkpoint_tokenizer(str(hf), 32, str(hf))
    files = repeat_task(tmp_path, train=120, dev=20)
    cache = tmp_path / "cache"

    def inputs(*overrides, cache_dir=cache):
        cfg = load_finetune_config(None, ["task.name=rte", *overrides]
                                   + ([f"task.cache_dir={cache_dir}"] if cache_dir else []))
        run = SimpleNamespace(cfg=cfg, task=TASKS["rte"].configured(cfg.task), tokenizer=tokenizer,
                              parallel=SimpleNamespace(rank=0, logging_rank=0))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune"):
            read, features = Finetuner._inputs(run, str(files["train"]), "train", training=True)
        said = " ".join(r.getMessage() for r in caplog.records)
        return read, features, said

    fresh_read, fresh, said = inputs(cache_dir=None)
    assert "cache" not in said and not cache.exists()
    _, first, said = inputs()
    assert "tokenized, cached in" in said and len(list(cache.iterdir())) == 1
    read, second, said = inputs()
    assert "tokenized inputs from the cache" in said and "tokenized, cached" not in said
    assert f"{files['train']}: 120 rows after the header line, 120 examples" in said  # the read report, as before
    for name in FEATURES:
        assert torch.equal(getattr(second, name), getattr(fresh, name)), name
        assert torch.equal(getattr(first, name), getattr(fresh, name)), name
    assert read.examples == fresh_read.examples and len(second) == 120

    # another task setting, another entry
    _, shorter, said = inputs("task.max_seq_length=8")
    assert "tokenized, cached in" in said and len(list(cache.iterdir())) == 2
    assert shorter.input_ids.shape[-1] == 8 != fresh.input_ids.shape[-1]
    # the file's bytes changed: tokenized again
    files["train"].write_text(files["train"].read_text().replace("not_entailment", "entailment", 1))
    _, changed, said = inputs()
    assert "tokenized, cached in" in said and len(list(cache.iterdir())) == 3
    assert not torch.equal(changed.labels, fresh.labels)
    # a damaged entry: said, made again, replaced
    for entry in cache.iterdir():
        entry.write_bytes(b"not a pickle")
    _, again, said = inputs()
    assert "unreadable tokenized inputs" in said and "tokenized, cached in" in said
    assert torch.equal(again.input_ids, changed.input_ids)
    _, _, said = inputs()
    assert "tokenized inputs from the cache" in said
