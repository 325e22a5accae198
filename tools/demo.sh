#!/usr/bin/env bash
# End-to-end demo on CPU: install, then pretrain a tiny BERT with tensor x data parallelism
# (TP2 x DP2, ZeRO-1, LAMB) on the deterministic synthetic corpus, with TensorBoard logs and
# checkpoints, stop half way, and resume from the checkpoint to the end.
# Outputs go to ./outputs/demo (TensorBoard: tensorboard --logdir outputs/demo/tensorboard).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh
. .venv/bin/activate
out=outputs/demo
rm -rf "$out"
args=(--config configs/bert-tiny.yaml
      parallel.tensor_parallel=2 parallel.zero_stage=1
      model.vocab_size=512 data.seq_length=64 data.max_predictions_per_seq=10
      train.global_batch_size=32 train.micro_batch_size=8 train.train_steps=300 train.log_interval=25
      scheduler.warmup_steps=30 train.eval_interval=150 train.eval_steps=2
      # a model this small learns fastest with LAMB's trust ratio on every parameter
      optimizer.lr=1e-2 "optimizer.no_layer_adaptation=[]"
      train.save_dir="$out/checkpoints" train.load_dir="$out/checkpoints" train.save_interval=150
      train.tensorboard_dir="$out/tensorboard")
export OMP_NUM_THREADS=1
echo "== first half (stops after 150 steps, saving a checkpoint)"
./launcher.sh --nproc-per-node 4 pretrain "${args[@]}" train.exit_after_steps=150
echo "== resume from $out/checkpoints/$(cat "$out/checkpoints/latest") to the end"
./launcher.sh --nproc-per-node 4 pretrain "${args[@]}"
echo "== done: checkpoints in $out/checkpoints, TensorBoard logs in $out/tensorboard"
echo "   view them with: .venv/bin/tensorboard --logdir $out/tensorboard"
