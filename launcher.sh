#!/usr/bin/env bash
# Launch pretraining (or any program of this repo) on this node with N processes.
#
#   launcher.sh [--launcher torchrun|deepspeed] [--nproc-per-node N] [--master-port P]
#               pretrain --config configs/bert-base.yaml [section.key=value ...]
#   launcher.sh [...] finetune TASK [--config FILE] [section.key=value ...]
#   launcher.sh [...] tool tools/SCRIPT.py [ARGS...]
#
# The world size is nproc-per-node; tensor/pipeline parallel sizes come from the config
# (parallel.tensor_parallel, parallel.pipeline_parallel) and data parallelism takes the rest.
# A pretraining config is validated for that world size before any process starts.
# CPU runs use gloo; with GPUs present the same command uses NCCL, one process per GPU.
# The exact command is printed before it runs. Environment such as GLOO_SOCKET_IFNAME,
# NCCL_SOCKET_IFNAME or OMP_NUM_THREADS passes through to every rank.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
launcher=torchrun
nproc=""
master_port=29500

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --nproc-per-node) nproc="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    pretrain|finetune|tool) break ;;
    *) echo "launcher.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "launcher.sh: name a program: pretrain, finetune or tool" >&2; usage; }
program="$1"; shift

if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc="$(nvidia-smi -L | wc -l)"
  else
    nproc=1
  fi
fi

case "$program" in
  pretrain) target=(-m pretrain "$@")
            python -m pretrain --check-config --world-size "$nproc" "$@" ;;
  finetune) target=(-m finetune "$@") ;;
  tool)     [[ $# -gt 0 ]] || { echo "launcher.sh: tool needs a script path" >&2; exit 2; }
            target=("$@") ;;
esac

case "$launcher" in
  torchrun)  cmd=(python -m torch.distributed.run --nnodes 1 --nproc-per-node "$nproc"
                  --master-addr 127.0.0.1 --master-port "$master_port" "${target[@]}") ;;
  deepspeed) if [[ "${target[0]}" == "-m" ]]; then target=(--module "${target[@]:1}"); fi
             cmd=(deepspeed --num_gpus "$nproc" --master_addr 127.0.0.1 --master_port "$master_port" "${target[@]}") ;;
  *) echo "launcher.sh: unknown launcher '$launcher' (torchrun or deepspeed)" >&2; exit 2 ;;
esac

cd "$here"
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
