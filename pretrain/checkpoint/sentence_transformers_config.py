"""The files that make a Hugging Face encoder directory a sentence-transformers model: modules.json
(the transformer, then pooling, then optionally normalisation), sentence_bert_config.json (the
maximum length), 1_Pooling/config.json and config_sentence_transformers.json, in the layout every
sentence-transformers release since 2 loads (`SentenceTransformer(path)`, offline). Without them
sentence-transformers guesses: mean pooling, and the tokenizer's length. Torch-free.
"""
from __future__ import annotations

import json
import os

POOLING_MODES = ("mean", "cls", "lasttoken")


def write_sentence_transformers_config(out_dir: str, max_seq_length: int, hidden_size: int, pooling: str = "mean",
                                       normalize: bool = False, do_lower_case: bool = False) -> list[str]:
    """Write the sentence-transformers files into out_dir (beside config.json and the weights);
    returns the paths written, relative to out_dir."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLING_MODES)}")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling_config = {"word_embedding_dimension": hidden_size,
                      "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
                      "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                      "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken",
                      "include_prompt": True}
    files = {"modules.json": modules,
             "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case},
             "config_sentence_transformers.json": {"prompts": {}, "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"},
             os.path.join("1_Pooling", "config.json"): pooling_config}
    if normalize:
        os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
    for name, content in files.items():
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return sorted(files)
