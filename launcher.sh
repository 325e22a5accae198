#!/usr/bin/env bash
# Launch pretraining, fine-tuning or a tool of this repo on one node or many.
#
#   launcher.sh [--launcher torchrun|deepspeed|mpirun|slurm] [--nproc-per-node K]
#               [--hostfile FILE] [--nnodes N] [--node-rank R]
#               [--master-addr ADDR] [--master-port PORT] [--max-restarts N] [--dry-run]
#               {pretrain|finetune|tool} ARGS...
#
#   pretrain --config configs/bert-base.yaml [section.key=value ...]
#   finetune TASK|embed [--config FILE] [section.key=value ...]
#   tool tools/SCRIPT.py [ARGS...]
#
# Launchers (default torchrun):
#   torchrun   run once on every node, each with its --node-rank; --master-addr is node 0. Runs as
#              pretrain.resilience.torchrun: torchrun, its failure report one line per rank.
#   deepspeed  one node: --nproc-per-node; several: --hostfile. With --node-rank, every node runs
#              the launcher itself (deepspeed --no_ssh); without it, node 0 starts all nodes by ssh.
#   mpirun     mpiexec (MPICH or Open MPI) starts every rank; several nodes need --hostfile.
#   slurm      srun inside an allocation (sbatch/salloc); nodes and tasks per node from the options.
# A hostfile is DeepSpeed's format, one node a line: "HOSTNAME slots=K" (# starts a comment). It
# sets --nnodes, --nproc-per-node (slots) and, unless given, --master-addr (the first host).
# The world size is nnodes x nproc-per-node; tensor/pipeline parallel sizes come from the config
# and data parallelism takes the rest. A pretraining config is validated for that world size
# before anything starts. --nproc-per-node defaults to the GPUs this shell sees (nvidia-smi,
# narrowed by CUDA_VISIBLE_DEVICES; 1 on CPU), and to 1 for `tool` (converters and inspectors
# are single-process unless told otherwise). CPU runs use gloo, GPU runs NCCL. The exact command
# is printed ("+ ...") before it runs; --dry-run stops there. Environment such as
# CUDA_VISIBLE_DEVICES, NCCL_*/GLOO_*/FI_*/UCX_* network settings, PYTORCH_CUDA_ALLOC_CONF,
# LD_LIBRARY_PATH or OMP_NUM_THREADS reaches every rank, on every node, with every launcher.
#
# Signals and restarts (every launcher): SIGTERM to the job (scancel, a time limit, a preemption,
# `kill` of this script or of its whole process group) makes the ranks save one checkpoint and stop;
# the launch then exits 0 with "launcher.sh: the job stopped (...)". A job whose rank failed on bad
# input ends with that rank's one-line error: "launcher.sh: the job failed (exit N): MESSAGE".
# --max-restarts N (default 0) starts a failed job again, up to N times,
# each run resuming from checkpoint.load_dir's latest checkpoint: a killed, crashed or hung rank (the
# watchdog, resilience.hang_timeout_minutes) restarts; bad input and non-finite training do not, and
# neither does a stop on SIGTERM. On several nodes give every node's launcher the same N; restart k
# rendezvous at --master-port + k, so keep those ports free too. --master-port defaults to
# $MASTER_PORT, else: on one node a free port below the kernel's ephemeral range, with the
# restarts' ports after it free too (as torchrun --standalone takes one), so that two jobs can
# share a node; on several nodes 29500 (as torchrun). On one node, a named port that is in use is
# refused before anything starts.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
launcher=torchrun
nproc=""
nnodes=""
node_rank=""
hostfile=""
master_addr=""
master_port="${MASTER_PORT:-}"  # torchrun's reading of MASTER_PORT; unset: chosen below
max_restarts=0
dry_run=0
# Variables every rank needs besides its launcher's own (exported explicitly where a launcher
# does not pass the whole environment: Open MPI, and DeepSpeed's ssh mode).
passthrough_re='^(GLOO_|NCCL_|OMP_|TP_SOCKET_IFNAME|MASTER_PORT|PYTHON|PYTORCH_|TORCH_|CUDA_|FI_|UCX_|LD_LIBRARY_PATH=|HF_|BERT_|WANDB_|MLFLOW_)'

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit "${1:-2}"; }
fail() { echo "launcher.sh: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || fail "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) need_value "$@"; launcher="$2"; shift 2 ;;
    --nproc-per-node) need_value "$@"; nproc="$2"; shift 2 ;;
    --nnodes) need_value "$@"; nnodes="$2"; shift 2 ;;
    --node-rank) need_value "$@"; node_rank="$2"; shift 2 ;;
    --hostfile) need_value "$@"; hostfile="$2"; shift 2 ;;
    --master-addr) need_value "$@"; master_addr="$2"; shift 2 ;;
    --master-port) need_value "$@"; master_port="$2"; shift 2 ;;
    --max-restarts) need_value "$@"; max_restarts="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    pretrain|finetune|tool) break ;;
    *) echo "launcher.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "launcher.sh: name a program: pretrain, finetune or tool" >&2; usage; }
program="$1"; shift

for pair in "--nproc-per-node:$nproc" "--nnodes:$nnodes" "--node-rank:$node_rank" "--master-port:$master_port" \
            "--max-restarts:$max_restarts"; do
  [[ -z "${pair#*:}" || "${pair#*:}" =~ ^[0-9]+$ ]] || fail "${pair%%:*} must be a non-negative integer, got '${pair#*:}'"
done

# --- the hostfile: nodes, slots per node, first host -------------------------------------------
hosts=()
if [[ -n "$hostfile" ]]; then
  [[ -f "$hostfile" ]] || fail "hostfile '$hostfile' not found"
  slots=""
  lineno=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    [[ -z "${line//[[:space:]]/}" ]] && continue
    if [[ ! "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+slots=([0-9]+)[[:space:]]*$ ]]; then
      fail "$hostfile line $lineno: expected 'HOSTNAME slots=K', got '$line'"
    fi
    hosts+=("${BASH_REMATCH[1]}")
    if [[ -n "$slots" && "$slots" != "${BASH_REMATCH[2]}" ]]; then
      fail "$hostfile line $lineno: every node needs the same slots (found $slots and ${BASH_REMATCH[2]})"
    fi
    slots="${BASH_REMATCH[2]}"
  done < "$hostfile"
  [[ ${#hosts[@]} -gt 0 ]] || fail "hostfile '$hostfile' lists no hosts"
  [[ -z "$nnodes" || "$nnodes" == "${#hosts[@]}" ]] || fail "--nnodes $nnodes disagrees with $hostfile (${#hosts[@]} hosts)"
  [[ -z "$nproc" || "$nproc" == "$slots" ]] || fail "--nproc-per-node $nproc disagrees with $hostfile (slots=$slots)"
  nnodes="${#hosts[@]}"
  nproc="$slots"
  master_addr="${master_addr:-${hosts[0]}}"
fi

if [[ -z "$nnodes" ]]; then
  nnodes=1
  [[ "$launcher" == slurm && -n "${SLURM_JOB_NUM_NODES:-}" ]] && nnodes="$SLURM_JOB_NUM_NODES"
fi
# GPUs this shell may use: nvidia-smi's list, narrowed by CUDA_VISIBLE_DEVICES when it is set.
visible_gpus=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    IFS=, read -r -a visible_gpus <<< "$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t visible_gpus < <(seq 0 $(( $(nvidia-smi -L | wc -l) - 1 )))
  fi
fi
if [[ -z "$nproc" ]]; then
  if [[ "$program" == tool || ${#visible_gpus[@]} -eq 0 ]]; then nproc=1; else nproc=${#visible_gpus[@]}; fi
fi
if (( ${#visible_gpus[@]} > 0 && nproc > ${#visible_gpus[@]} )); then
  fail "--nproc-per-node $nproc but this node sees ${#visible_gpus[@]} GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}): one rank per GPU"
fi
(( nnodes >= 1 && nproc >= 1 )) || fail "--nnodes and --nproc-per-node must be at least 1"
world=$((nnodes * nproc))
if [[ -n "$node_rank" ]] && (( node_rank >= nnodes )); then
  fail "--node-rank $node_rank is not below --nnodes $nnodes"
fi
if (( nnodes == 1 )); then
  master_addr="${master_addr:-127.0.0.1}"
  node_rank="${node_rank:-0}"
fi

# The repo's venv (tools/install.sh) when none is active: python, deepspeed and mpiexec come from it.
if [[ -z "${VIRTUAL_ENV:-}" && -x "$here/.venv/bin/python" ]]; then
  export PATH="$here/.venv/bin:$PATH"
fi

# --- the rendezvous port -----------------------------------------------------------------------
free_port() {  # $1: consecutive ports wanted (pretrain/distributed/ports.py)
  python -c 'import sys; from pretrain.distributed.ports import free_port; print(free_port(int(sys.argv[1])))' "$1"
}
port_in_use() {  # as the rendezvous store binds it: a port only in TIME_WAIT is free
  python -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)' "$1"
}
if [[ -z "$master_port" ]]; then
  if (( nnodes == 1 )); then
    master_port="$(PYTHONPATH="$here" free_port $((max_restarts + 1)))"
  else
    master_port=29500
  fi
elif (( nnodes == 1 )) && port_in_use "$master_port"; then
  fail "--master-port $master_port is in use on this node (another job's rendezvous?): name a free port, or leave --master-port (and MASTER_PORT) out to take a free one"
fi

# --- what every rank runs ----------------------------------------------------------------------
case "$program" in
  pretrain) target=(-m pretrain "$@") ;;
  finetune) target=(-m finetune "$@") ;;
  tool)     [[ $# -gt 0 ]] || fail "tool needs a script path"
            script="$1"; shift
            [[ -f "$script" || ! -f "$here/$script" ]] || script="$here/$script"
            [[ -f "$script" ]] || fail "tool script '$script' not found"
            target=("$script" "$@") ;;
esac
# The ranks import this repo's packages wherever they start.
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export MASTER_PORT="$master_port"

multi_node_needs() {  # $1: what is missing, for a multi-node run
  (( nnodes == 1 )) || fail "$launcher across $nnodes nodes needs $1"
}

case "$launcher" in
  torchrun)
    [[ -n "$node_rank" ]] || multi_node_needs "--node-rank (run it once on every node)"
    [[ -n "$master_addr" ]] || multi_node_needs "--master-addr (node 0's address) or --hostfile"
    # torchrun's own default (1 thread a rank when several share the node), set here so that torchrun
    # does not print its banner about it on every launch
    if [[ -z "${OMP_NUM_THREADS:-}" ]] && (( nproc > 1 )); then export OMP_NUM_THREADS=1; fi
    # torch.distributed.run itself, with a failure reported in one line per rank, not a traceback
    cmd=(python -m pretrain.resilience.torchrun --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc"
         --master-addr "$master_addr" --master-port "$master_port" "${target[@]}") ;;
  deepspeed)
    if [[ "${target[0]}" == "-m" ]]; then target=(--module "${target[@]:1}"); fi
    if [[ -z "$hostfile" ]]; then
      multi_node_needs "--hostfile"
      if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && ${#visible_gpus[@]} -gt 0 ]]; then
        # --num_gpus would make DeepSpeed drop CUDA_VISIBLE_DEVICES and count from GPU 0
        devices="$(IFS=,; echo "${visible_gpus[*]:0:$nproc}")"
        cmd=(deepspeed --include "localhost:$devices" --master_addr "$master_addr" --master_port "$master_port" "${target[@]}")
      else
        cmd=(deepspeed --num_gpus "$nproc" --master_addr "$master_addr" --master_port "$master_port" "${target[@]}")
      fi
    elif [[ -n "$node_rank" ]]; then
      cmd=(deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$node_rank"
           --master_addr "$master_addr" --master_port "$master_port" "${target[@]}")
    else
      # Node 0 starts every node by ssh (pdsh); DeepSpeed exports the variables of this file.
      if [[ -z "${DS_ENV_FILE:-}" ]] && (( dry_run == 0 )); then
        DS_ENV_FILE="$(mktemp "${TMPDIR:-/tmp}/launcher-deepspeed-env.XXXXXX")"
        env | grep -E "$passthrough_re" > "$DS_ENV_FILE" || true
        export DS_ENV_FILE
      fi
      cmd=(deepspeed --hostfile "$hostfile" --master_addr "$master_addr" --master_port "$master_port" "${target[@]}")
    fi ;;
  mpirun)
    mpiexec="$(dirname "$(command -v python)")/mpiexec"
    [[ -x "$mpiexec" ]] || mpiexec="$(command -v mpiexec || true)"
    [[ -n "$mpiexec" ]] || fail "mpirun: no mpiexec found (tools/install.sh installs MPICH into the venv)"
    [[ -n "$hostfile" ]] || multi_node_needs "--hostfile"
    if "$mpiexec" --version 2>&1 | grep -q "Open MPI"; then
      cmd=("$mpiexec" -np "$world" --map-by "ppr:$nproc:node" -x "MASTER_ADDR=$master_addr")
      [[ -z "$hostfile" ]] || cmd+=(--hostfile "$hostfile")
      while IFS= read -r name; do cmd+=(-x "$name"); done < <(env | grep -E "$passthrough_re" | cut -d= -f1)
    else  # MPICH (Hydra) passes the whole environment by default
      cmd=("$mpiexec" -n "$world" -ppn "$nproc" -genv MASTER_ADDR "$master_addr")
      [[ -z "$hostfile" ]] || cmd+=(-hosts "$(IFS=,; echo "${hosts[*]}")")
    fi
    cmd+=(python "${target[@]}") ;;
  slurm)
    [[ -z "$hostfile" ]] || fail "slurm takes its nodes from the allocation, not from --hostfile"
    # MASTER_ADDR: given, or the allocation's first node (read from SLURM_JOB_NODELIST by each rank).
    [[ -z "$master_addr" || "$nnodes" == 1 && "$master_addr" == 127.0.0.1 ]] || export MASTER_ADDR="$master_addr"
    # --mpi=none: ranks come from SLURM's variables; a PMI plugin would make mpi4py's MPI (which may
    # not speak it) report every task as rank 0 of 1
    cmd=(srun --mpi=none --nodes "$nnodes" --ntasks-per-node "$nproc" --kill-on-bad-exit=1 python "${target[@]}") ;;
  *) fail "unknown launcher '$launcher' (torchrun, deepspeed, mpirun or slurm)" ;;
esac

if [[ "$program" == pretrain ]]; then
  restartable=()
  (( max_restarts == 0 )) || restartable=(--restartable)
  python -m pretrain --check-config --world-size "$world" "${restartable[@]}" "$@"
fi
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
(( dry_run == 0 )) || exit 0

# --- run, restart, and answer signals ------------------------------------------------------------
# The ranks write their pids and how they ended into this directory (pretrain/resilience/launch_status.py).
status_dir="$(mktemp -d "${TMPDIR:-/tmp}/launcher-status.XXXXXX")"
export BERT_LAUNCH_STATUS_DIR="$status_dir"
child=""
signalled=""
trap 'rm -rf "$status_dir"' EXIT
forward() {  # $1: TERM or INT, received by this script
  signalled="$1"
  # Ctrl-C reaches every process of the terminal's group by itself; a SIGTERM may have come to this
  # script alone: it goes to the ranks (which save and stop), not to the tool between.
  [[ "$1" == TERM ]] || return 0
  local pidfile
  for pidfile in "$status_dir"/pid-*; do
    [[ -f "$pidfile" ]] && kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
  done
  # srun and mpiexec deliver it to ranks on other nodes, whose pid files are not here
  if [[ -n "$child" && ( "$launcher" == slurm || "$launcher" == mpirun ) ]]; then kill -TERM "$child" 2>/dev/null || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT

wait_for_ranks() {  # a tool may end before its ranks (DeepSpeed's runner on SIGTERM): wait up to 60 s
  local pidfile pid deadline=$((SECONDS + 60))
  for pidfile in "$status_dir"/pid-*; do
    [[ -f "$pidfile" ]] || continue
    pid="$(cat "$pidfile")"
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
  done
}

rank_outcome() {  # the first rank's line starting with $1 (stopped|failed), without the word
  local line
  line="$(grep -h "^$1 " "$status_dir"/rank-* 2>/dev/null | head -n 1 || true)"
  echo "${line#"$1 "}"
}

# Restart k rendezvous at --master-port + k: on several nodes each node's launcher restarts on its
# own, and one that restarts first must not join the previous attempt's store, still served until
# node 0's tool has ended (it would start its ranks with that attempt's stale rendezvous).
for_attempt() {  # $1: the attempt; sets run_cmd and MASTER_PORT
  local port=$((master_port + $1)) previous="" arg
  run_cmd=()
  for arg in "${cmd[@]}"; do
    [[ "$previous" != --master-port && "$previous" != --master_port ]] || arg="$port"
    run_cmd+=("$arg")
    previous="$arg"
  done
  export MASTER_PORT="$port"
}

attempt=0
while :; do
  rm -f "$status_dir"/pid-* "$status_dir"/rank-*
  for_attempt "$attempt"
  "${run_cmd[@]}" &
  child=$!
  while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done  # a trapped signal ends wait early
  code=0
  wait "$child" || code=$?
  child=""
  (( code == 0 )) || wait_for_ranks
  stopped="$(rank_outcome stopped)"
  if [[ -n "$stopped" ]]; then  # a complete checkpoint was saved before the stop (the tool may say 0 or not)
    echo "launcher.sh: the job stopped ($stopped); launch it again to resume" >&2
    exit 0
  fi
  (( code != 0 )) || exit 0
  if [[ "$signalled" == INT ]]; then  # Ctrl-C: stop now, without a save
    echo "launcher.sh: interrupted (SIGINT); a relaunch resumes from the last complete checkpoint the ranks named" >&2
    exit 130
  fi
  if [[ -n "$signalled" ]]; then
    echo "launcher.sh: SIGTERM: the job ended (exit $code) before it could save" >&2
    exit 143
  fi
  failed="$(rank_outcome failed)"
  if [[ -n "$failed" ]]; then  # a rank's one-line error: the last line, after the tool's own report
    if (( max_restarts > 0 )); then
      echo "launcher.sh: not restarting: a restart would fail the same way ($failed)" >&2
    else
      echo "launcher.sh: the job failed (exit $code): $failed" >&2
    fi
    exit "$code"
  fi
  if (( attempt < max_restarts )); then
    attempt=$((attempt + 1))
    echo "launcher.sh: the job failed (exit $code); restart $attempt of $max_restarts, resuming from the latest checkpoint (rendezvous port $((master_port + attempt)))" >&2
    continue
  fi
  if (( max_restarts > 0 )); then
    echo "launcher.sh: the job failed (exit $code) and its $max_restarts restart(s) are spent (--max-restarts); see the ranks' errors above" >&2
  fi
  exit "$code"
done
