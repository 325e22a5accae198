"""Rank entry point (one process): one contrastive step of our encoder against sentence-transformers'.

usage: python tests/_embed_st_parity_worker.py OUT.json MODEL_DIR

The same Hugging Face BERT directory is loaded twice: as our encoder (pretrain's model, the
trainer's Embedder, mean pooling) and as `SentenceTransformer` (Transformer + mean Pooling). On the
same tokenized batch (anchors, positives, one column of hard negatives), each computes the loss of
one step and its gradients: ours with ContrastiveLoss (padded rows, packed rows, and gradient-cached
in mini-batches of 2), theirs with MultipleNegativesRankingLoss and
CachedMultipleNegativesRankingLoss (mini_batch_size 2). Writes each loss and, per parameter (by its
Hugging Face name), the largest difference of our gradients from theirs.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

import torch  # noqa: E402

from finetune.embedding.gradcache import TorchRandomState, cached_step  # noqa: E402
from finetune.embedding.loss import ContrastiveLoss  # noqa: E402
from finetune.embedding.trainer import Embedder, packed_inputs  # noqa: E402
from finetune.model import build_encoder, load_encoder  # noqa: E402
from pretrain.checkpoint.hf import read_hf  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402
from pretrain.model.names import logical_parameters  # noqa: E402
from pretrain.model.rng import RngTracker, seed_streams  # noqa: E402

COLUMNS = [["the cat w1", "w2 w3 hello", "who are w4 w5", "world w6", "cafe w7 w8 w9"],
           ["the cat w1 in the cafe", "w2 w3 hello world", "who are w4", "the world w6 w6", "naive cafe w7"],
           ["w10 w11", "the w12 w13 w14", "w15 cat", "are w16 w17 in", "w18"]]


def ours(model_dir: str, parallel, features, mode: str):
    ckpt = read_hf(model_dir)
    m = ckpt.config.model
    tracker = RngTracker(parallel.device)
    seed_streams(tracker, 0, 0, 0, 0)
    bert = build_encoder(m, parallel.tp_group, tracker)
    load_encoder(bert, ckpt.weights, m, 0, 1)
    for lp in logical_parameters(bert):
        if lp.hf_name.startswith("bert.pooler."):
            lp.param.requires_grad_(False)
    model = Embedder(bert, "mean", False).train()
    loss_fn = ContrastiveLoss(scale=20.0, symmetric=False)

    def embed(rows_and_masks):
        ids, mask = rows_and_masks
        if mode == "padded":
            return model(ids, torch.zeros_like(ids), mask)
        rows = [row[:int(n)].tolist() for row, n in zip(ids, mask.sum(1))]
        return model(*packed_inputs(rows, ids.shape[1], 1, parallel.device))

    def whole_loss(embeddings):
        return loss_fn(embeddings[0], embeddings[1], embeddings[2:])

    columns = [(f["input_ids"], f["attention_mask"]) for f in features]
    if mode == "cached":
        minis = [[(ids[i:i + 2], mask[i:i + 2]) for i in range(0, len(ids), 2)] for ids, mask in columns]
        loss = cached_step(minis, embed, whole_loss, TorchRandomState(parallel.device, tracker))
    else:
        loss = whole_loss([embed(c) for c in columns])
        loss.backward()
    vocab = m.vocab_size
    grads = {lp.hf_name.removeprefix("bert."): lp.param.grad[:vocab] if "word_embeddings" in lp.hf_name else lp.param.grad
             for lp in logical_parameters(bert) if lp.param.grad is not None}
    return float(loss.detach()), grads


def theirs(model_dir: str, cached: bool):
    from sentence_transformers import SentenceTransformer
    try:  # sentence-transformers >= 6 (the old paths warn)
        from sentence_transformers.sentence_transformer import losses, modules as models
    except ImportError:
        from sentence_transformers import losses, models

    transformer = models.Transformer(model_dir)
    model = SentenceTransformer(modules=[transformer, models.Pooling(transformer.auto_model.config.hidden_size, "mean")],
                                device="cpu")
    model.train()
    loss_fn = (losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, show_progress_bar=False) if cached
               else losses.MultipleNegativesRankingLoss(model))
    features = [model.tokenize(texts) for texts in COLUMNS]
    loss = loss_fn([dict(f) for f in features], None)
    loss.backward()
    grads = {name: p.grad for name, p in transformer.auto_model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, features


def main():
    out_path, model_dir = sys.argv[1], sys.argv[2]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1, timeout_minutes=5)
    results = {}
    for cached in (False, True):
        their_loss, their_grads, features = theirs(model_dir, cached)
        for mode in (("cached",) if cached else ("padded", "packed")):
            our_loss, our_grads = ours(model_dir, parallel, features, mode)
            results[mode] = {"ours": our_loss, "theirs": their_loss, "names": sorted(their_grads),
                             "our_names": sorted(our_grads),
                             "max_difference": {name: float((our_grads[name] - g).abs().max())
                                                for name, g in their_grads.items() if name in our_grads},
                             "scale": max(float(g.abs().max()) for g in their_grads.values())}
    if parallel.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
