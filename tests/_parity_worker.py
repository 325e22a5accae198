"""Rank entry point: Hugging Face BertForPreTraining vs our model at TP = world size.

usage: python tests/_parity_worker.py OUT.json
Both models get the same weights (HF's random init, converted through HF_NAME_TABLE) and the
same inputs; rank 0 writes the largest absolute differences of MLM logits, NSP logits and loss.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()  # the known noise only: anything new shows up in the test run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import BertConfig, BertForPreTraining  # noqa: E402

from pretrain.config import ModelConfig  # noqa: E402
from pretrain.data.samples.batches import collate, collate_packed, split_inputs_labels  # noqa: E402
from pretrain.data.samples.synthetic import SyntheticDataset  # noqa: E402
from pretrain.model.bert import PretrainingLoss, build_model  # noqa: E402
from pretrain.model.layers import TransformerLayer  # noqa: E402
from pretrain.checkpoint.sharding import load_hf_state_dict  # noqa: E402
from pretrain.model.rng import RngTracker, seed_streams  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, PREDICTIONS = 250, 64, 2, 4, 32, 6


def ours(model, parallel, inputs, labels):
    """Our MLM logits over the whole vocabulary (gathered over TP), NSP logits and loss."""
    mlm_local, nsp = model(inputs)
    loss = PretrainingLoss(parallel.tp_group, parallel.tp_rank)((mlm_local.clone(), nsp), labels)
    pieces = [torch.empty_like(mlm_local) for _ in range(parallel.tp_size)]
    dist.all_gather(pieces, mlm_local.contiguous(), group=parallel.tp_group)
    return torch.cat(pieces, dim=-1), nsp, loss


def hugging_face(hf, inputs, labels):
    """HF's outputs for padded inputs, and its MLM logits at our masked positions."""
    input_ids, token_types, padding_mask, positions = inputs
    masked_labels, weights, nsp_labels = labels
    hf_labels = torch.full_like(input_ids, -100)
    for row in range(input_ids.shape[0]):
        keep = weights[row] > 0
        hf_labels[row, positions[row][keep]] = masked_labels[row][keep]
    ref = hf(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask,
             labels=hf_labels, next_sentence_label=nsp_labels)
    return ref, torch.gather(ref.prediction_logits, 1, positions.unsqueeze(-1).expand(-1, -1, VOCAB))


def per_sample_losses(mlm, nsp, labels):
    """Each sample's MLM loss (mean over its masked tokens) and NSP loss."""
    masked_labels, weights, nsp_labels = labels
    per_token = torch.nn.functional.cross_entropy(mlm[..., :VOCAB].transpose(1, 2), masked_labels, reduction="none")
    return (per_token * weights).sum(1) / weights.sum(1), torch.nn.functional.cross_entropy(nsp, nsp_labels,
                                                                                        reduction="none")


def packed_vs_hugging_face(model, hf, parallel) -> dict:
    """Samples of 8-32 tokens packed into rows of 32 (data.packing) against HF on them padded:
    per-sample logits and losses."""
    data = SyntheticDataset(VOCAB, SEQ, PREDICTIONS, 100, seed=6, min_fraction=0.1)
    samples = [data[i] for i in range(8)]
    padded_inputs, labels = split_inputs_labels(collate(samples), parallel.device)
    packed_inputs, packed_labels = split_inputs_labels(collate_packed(samples)[0], parallel.device)
    mlm, nsp, _ = ours(model, parallel, packed_inputs, packed_labels)
    ref, ref_mlm = hugging_face(hf, padded_inputs, labels)
    mlm_loss, nsp_loss = per_sample_losses(mlm, nsp, labels)
    ref_mlm_loss, ref_nsp_loss = per_sample_losses(ref_mlm, ref.seq_relationship_logits, labels)
    return {"packed_rows": packed_inputs[0].shape[0], "packed_samples": len(samples),
            "packed_mlm_max_abs": (mlm[..., :VOCAB] - ref_mlm).abs().max().item(),
            "packed_nsp_max_abs": (nsp - ref.seq_relationship_logits).abs().max().item(),
            "packed_mlm_loss_max_abs": (mlm_loss - ref_mlm_loss).abs().max().item(),
            "packed_nsp_loss_max_abs": (nsp_loss - ref_nsp_loss).abs().max().item()}


def main():
    out_path = sys.argv[1]
    world = int(os.environ["WORLD_SIZE"])
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, world, 1)
    model_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
                            ffn_hidden_size=4 * HIDDEN, max_position_embeddings=64, hidden_dropout=0.0,
                            attention_dropout=0.0)
    padded = model_cfg.padded_vocab_size(parallel.tp_size)

    torch.manual_seed(1234)  # identical HF model on every rank
    hf = BertForPreTraining(BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make them random too
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)

    tracker = RngTracker(parallel.device)
    seed_streams(tracker, 1, parallel.tp_rank, 0, 0)
    model = build_model(model_cfg, padded, torch.float32, tracker, parallel.tp_group)
    load_hf_state_dict(model, hf.state_dict(), padded, parallel.tp_rank, parallel.tp_size)
    model.eval()

    data = SyntheticDataset(VOCAB, SEQ, PREDICTIONS, 100, seed=5)
    inputs, labels = split_inputs_labels(collate([data[i] for i in range(6)]), parallel.device)
    seen = []  # the shape of what the first encoder layer computed: the real tokens as one row
    first = next(m for m in model.modules() if isinstance(m, TransformerLayer))
    hook = first.register_forward_pre_hook(lambda _m, args: seen.append(list(args[0][0].shape)))
    with torch.no_grad():
        mlm, nsp, loss = ours(model, parallel, inputs, labels)
        hook.remove()
        ref, ref_mlm = hugging_face(hf, inputs, labels)
        packed = packed_vs_hugging_face(model, hf, parallel)
        # the pooled [CLS] with the last layer computed for [CLS] alone (sequence-level fine-tuning)
        pooled = model.pooled(inputs)
        ref_pooled = hf.bert(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2]).pooler_output
    result = {
        "mlm_max_abs": (mlm[..., :VOCAB] - ref_mlm).abs().max().item(),
        "mlm_scale": ref_mlm.abs().max().item(),
        "padded_vocab_max": mlm[..., VOCAB:].max().item() if padded > VOCAB else None,
        "nsp_max_abs": (nsp - ref.seq_relationship_logits).abs().max().item(),
        "loss": loss.item(),
        "hf_loss": ref.loss.item(),
        "tp": parallel.tp_size,
        "layer_input_shape": seen[0], "real_tokens": int(inputs[2].sum()), "rows_x_seq": inputs[2].numel(),
        **packed,
        "pooled_max_abs": (pooled - ref_pooled).abs().max().item(),
        "pooled_scale": ref_pooled.abs().max().item(),
    }
    if parallel.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
