"""Convert BERT and ModernBERT checkpoints between Hugging Face format and our native (DeepSpeed) layouts.

usage:
  python tools/convert_checkpoint.py hf-to-native --input HF_DIR --output DIR [--tp T] [--pp P]  (default TP1 x PP1)
  python tools/convert_checkpoint.py native-to-hf --input DIR --output HF_DIR [--vocab-file vocab.txt]
                                                [--architecture BertForPreTraining|BertForMaskedLM|BertModel|
                                                                ModernBertForMaskedLM|ModernBertModel]
  python tools/convert_checkpoint.py reshard --input DIR --output DIR --tp T --pp P [--no-optimizer]

hf-to-native reads BertForPreTraining, BertForMaskedLM or BertModel directories
(model.safetensors, pytorch_model.bin or their sharded index; with or without the `bert.` prefix;
LayerNorm.gamma/beta names). Heads the architecture lacks are initialised and listed. Every
tokenizer file is carried (vocab.txt, tokenizer.json, tokenizer_config.json, ...); a directory
without vocab.txt (transformers 5 writes none) gets the one its WordPiece tokenizer.json implies.
A tokenizer.json of another model (BPE, Unigram) without a vocab.txt is refused.
It also reads ModernBertForMaskedLM and ModernBertModel directories (config.json of
transformers 4.48+ or 5; their Wqkv and Wi rows reordered for tensor parallelism) with their
tokenizer.json (BPE), and writes them back as transformers saves them, config.json with both
generations' keys (global_attn_every_n_layers, *_rope_theta; layer_types, rope_parameters).

native-to-hf reads a checkpoint of any TP x PP x DP layout and ZeRO stage (DIR is a save_dir,
following its `latest`, or one iter_* directory), joins TP shards and ZeRO partitions (fp32
master weights where the run kept them), drops vocabulary padding, and writes config.json,
model.safetensors and the tokenizer files, as the architecture the checkpoint was trained as:
BertForPreTraining for pretraining checkpoints; a converted BertForMaskedLM or BertModel comes
back as itself, without the heads hf-to-native had to initialise. --architecture asks for
another (BertForPreTraining on such a checkpoint writes those untrained heads too). The
tokenizer's model_max_length is the longest length the model was trained at (every phase), and
the directory is a sentence-transformers model of that length too (mean pooling).

reshard rewrites a native checkpoint at another TP x PP, with its optimizer moments, step, sample
count and LR-schedule position: training resumes from it in any DP size and ZeRO stage.

Outputs are written to a temporary directory and renamed when complete: a failed conversion
leaves nothing behind. Their files get the modes the user's umask gives (0644 under umask 022).
Exit status: 0 done, 1 error, 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from pretrain.cli import accept_launcher_args, positive_int, run_command

# pretrain.checkpoint.hf's tuple (a test checks): importing it here would make --help wait for torch
PRETRAINING_ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel", "ModernBertForMaskedLM",
                            "ModernBertModel")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/convert_checkpoint.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_native = commands.add_parser("hf-to-native", help="Hugging Face directory -> native checkpoint")
    to_hf = commands.add_parser("native-to-hf", help="native checkpoint (any layout) -> Hugging Face directory")
    reshard = commands.add_parser("reshard", help="native checkpoint -> native checkpoint at another TP x PP")
    for sub in (to_native, to_hf, reshard):
        accept_launcher_args(sub)
        sub.add_argument("--input", required=True)
        sub.add_argument("--output", required=True, help="new (or empty) directory")
    # hf-to-native: a Hugging Face model becomes a one-process checkpoint unless told otherwise;
    # reshard exists to change the layout, so it asks
    for sub, default in ((to_native, 1), (reshard, None)):
        sub.add_argument("--tp", type=positive_int, default=default, required=default is None,
                         help="tensor-parallel size of the output" + (f" (default {default})" if default else ""))
        sub.add_argument("--pp", type=positive_int, default=default, required=default is None,
                         help="pipeline-parallel size of the output" + (f" (default {default})" if default else ""))
    to_native.add_argument("--seed", type=int, default=1234, help="seed for initialising missing heads")
    reshard.add_argument("--no-optimizer", action="store_true", help="write the model weights only")
    to_hf.add_argument("--vocab-file", help="vocab.txt to ship, when the checkpoint carries none "
                                            "(e.g. trained on synthetic data)")
    to_hf.add_argument("--architecture", choices=PRETRAINING_ARCHITECTURES,
                       help="transformers class to write (default: the one the checkpoint was trained as, "
                            "without heads it never trained; BertForPreTraining adds them as initialised)")
    return parser.parse_args(argv)


def describe_layout(path: str) -> str:
    from pretrain.checkpoint.format import read_meta, resolve_tag_dir

    layout = read_meta(resolve_tag_dir(path))["layout"]
    return (f"TP{layout['tensor_parallel']} x PP{layout['pipeline_parallel']} x DP{layout['data_parallel']}, "
            f"ZeRO-{layout['zero_stage']}, {layout.get('precision', 'fp32')}")


def run(args) -> list[str]:
    from pretrain.checkpoint.hf import architecture_note, read_hf, trained_architecture, write_hf
    from pretrain.checkpoint.logical import read_native, write_native

    if args.command == "hf-to-native":
        ckpt = read_hf(args.input, seed=args.seed)
        tag_dir = write_native(ckpt, args.output, args.tp, args.pp, converted_from=os.path.abspath(args.input))
        return ckpt.notes + [f"wrote {tag_dir} (TP{args.tp} x PP{args.pp}, weights only)"]
    if args.command == "native-to-hf":
        layout = describe_layout(args.input)
        ckpt = read_native(args.input, with_optimizer=False)
        architecture = args.architecture or trained_architecture(ckpt)
        files = write_hf(ckpt, args.output, vocab_file=args.vocab_file, architecture=architecture)
        return [f"read {ckpt.source} ({layout}, step {ckpt.step})", architecture_note(ckpt, architecture),
                f"wrote {args.output}: {', '.join(files)}"]
    layout = describe_layout(args.input)
    ckpt = read_native(args.input, with_optimizer=not args.no_optimizer)
    if args.no_optimizer:
        moments = "left out (--no-optimizer)"
    elif ckpt.moments is None:
        moments = "none in the input"
    else:
        moments = f"exp_avg and exp_avg_sq of every parameter, optimizer step {ckpt.optimizer_step}"
    tag_dir = write_native(ckpt, args.output, args.tp, args.pp, with_optimizer=not args.no_optimizer)
    return [f"read {ckpt.source} ({layout}, step {ckpt.step}, {ckpt.consumed_samples} samples)",
            f"optimizer state: {moments}",
            f"wrote {tag_dir} (TP{args.tp} x PP{args.pp}); RNG streams are not carried over (layout-specific)"]


def main(argv=None) -> int:
    return run_command(parse_args, convert, argv, name="convert_checkpoint", input_errors=(OSError,),
                       interrupted="no output written")


def convert(args: argparse.Namespace) -> None:
    # Conversion runs on the CPU whatever the machine has; keep the libraries' import chatter out.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import pretrain.checkpoint.hf  # noqa: F401  (imports first: "done in" times the conversion alone)

    started = time.perf_counter()
    for line in run(args):
        print(line)
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
