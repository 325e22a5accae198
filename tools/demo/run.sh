#!/usr/bin/env bash
# The whole flow on CPU, offline, in about 9 minutes on 2 cores (outputs in ./outputs/demo):
#   1. install (tools/install.sh: ./.venv)
#   2. corpus: the English prose that ships with Python itself (tools/demo/python_docs_corpus.py)
#   3. WordPiece vocabulary (tools/build_vocab.py) and .bin/.idx data (tools/preprocess_data.py)
#   4. pretrain BERT-tiny with TP2 x DP2 on 4 processes, ZeRO-1, LAMB, TensorBoard logs; it stops
#      half way and a second launch resumes from the checkpoint
#   5. convert the checkpoint to a Hugging Face directory (tools/convert_checkpoint.py)
#   6. fine-tune it on a sentence-pair task made from held-out documents (GLUE MRPC layout) on 2
#      data-parallel processes, with accuracy and F1 on the dev set
#   7. a PNG of the loss curves (tools/plot_curves.py) and [MASK] predictions (tools/fill_mask.py)
# Set DEMO_STEPS for a longer pretraining run (default 800).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
started=$SECONDS
bash tools/install.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
out=outputs/demo
steps="${DEMO_STEPS:-800}"
rm -rf "$out"
say() { printf '\n== [%dm%02ds] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

say "corpus: Python's own documentation"
python tools/demo/python_docs_corpus.py --output-dir "$out/data"

say "vocabulary and preprocessing"
python tools/build_vocab.py --input "$out/data/corpus.jsonl" --output-dir "$out/vocab" --vocab-size 8000
python tools/preprocess_data.py --input "$out/data/corpus.jsonl" --vocab-file "$out/vocab/vocab.txt" \
  --split-sentences --output-prefix "$out/data/pydocs" --workers 2 --quiet
python tools/inspect_dataset.py "$out/data/pydocs_text_sentence" --vocab-file "$out/vocab/vocab.txt" --decode 0

pretrain=(--config configs/demo.yaml
          "data.paths=[$out/data/pydocs_text_sentence]" data.vocab_file="$out/vocab/vocab.txt" model.vocab_size=8000
          train.train_steps="$steps" checkpoint.save_interval=$((steps / 2))
          checkpoint.save_dir="$out/checkpoints" checkpoint.load_dir="$out/checkpoints" logging.tensorboard_dir="$out/tensorboard/pretrain")
say "pretraining, TP2 x DP2: the first half (a checkpoint at step $((steps / 2)), then it stops)"
./launcher.sh --nproc-per-node 4 pretrain "${pretrain[@]}" resilience.exit_after_steps=$((steps / 2))
say "pretraining: a new launch resumes from $out/checkpoints/$(cat "$out/checkpoints/latest")"
./launcher.sh --nproc-per-node 4 pretrain "${pretrain[@]}"

say "conversion to a Hugging Face directory"
python tools/convert_checkpoint.py native-to-hf --input "$out/checkpoints" --output "$out/hf"

say "fine-tuning on held-out sentence pairs (does sentence 2 follow sentence 1?), DP2"
./launcher.sh --nproc-per-node 2 finetune mrpc \
  task.data_dir="$out/data/coherence" task.max_seq_length=64 model.init_from="$out/hf" \
  train.epochs=2 train.lr=3e-4 train.output_dir="$out/finetune" train.tensorboard_dir="$out/tensorboard/finetune"

say "loss curves and [MASK] predictions"
python tools/plot_curves.py --logdir "$out/tensorboard" --output "$out/loss_curves.png"
python tools/fill_mask.py --checkpoint "$out/hf" --top-k 5 \
  "The [MASK] statement is used for conditional execution." \
  "Return the number of [MASK] in the array." \
  "If the array is empty, a ValueError is [MASK]."

say "done in $(((SECONDS - started) / 60)) min $(((SECONDS - started) % 60)) s. Outputs in $out:"
echo "   checkpoints/ (native, TP2)  hf/ (Hugging Face)  finetune/ (metrics, best/, predictions)"
echo "   loss_curves.png             tensorboard/: .venv/bin/tensorboard --logdir $out/tensorboard"
