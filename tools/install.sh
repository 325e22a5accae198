#!/usr/bin/env bash
# Create ./.venv (if missing) and install the project with its test extras into it, and beside it the
# tests' CPU test device (tests/bert-fakegpu/: the distribution bert-fakegpu, import name fakegpu,
# never part of the product; a pip extra cannot name a folder, so it comes in the same pip command).
# torch is installed first and pinned: on CPU machines pip takes the CPU build lying on disk;
# an unpinned torch would pull a multi-GB CUDA build. GPU users may preinstall their own torch.
# pip's own output goes to .venv/install.log and is shown only when a step fails: what it prints on
# success (setuptools' notice on every editable install, a local index missing a package) tells
# the user nothing to do.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
log=.venv/install.log
: > "$log"
quietly() {  # run a pip step into the log; on failure show the log and fail
  if ! "$@" >> "$log" 2>&1; then
    cat "$log" >&2
    echo "install.sh: failed: $* (the output above is in $log)" >&2
    exit 1
  fi
}
quietly python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || quietly python -m pip install -q "torch==2.13.0"
quietly python -m pip install -q -e ".[test]" -e tests/bert-fakegpu
# The experiment trackers tests/test_trackers.py exercises (the wandb and mlflow extras) live beside
# the venv's packages, not among them: DeepSpeed and megatron-core import wandb and mlflow whenever
# they are installed, about 1.2 s more at every process start, which the suite's hundreds of ranks
# would all pay. Their dependencies stay in the venv; the two packages move to .venv/trackers, which
# only that test puts on its path.
quietly python -m pip install -q "wandb>=0.17" "mlflow-skinny>=2.10"
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .venv/trackers && mkdir -p .venv/trackers
mv "$site"/wandb "$site"/wandb-*.dist-info "$site"/mlflow "$site"/mlflow_skinny-*.dist-info .venv/trackers/
# the project's bytecode, written once: nobody compiles an editable install, and where
# PYTHONDONTWRITEBYTECODE is set (CI images often set it) every process would compile the ~300
# modules it imports from source again (about 1 s of each rank's start)
quietly python -m compileall -q -j 0 pretrain finetune tools tests
# the CPU test device's C++ extension (about 20 s of compiling), built with the environment rather
# than inside whichever test first runs on fakegpu
quietly env BERT_FAKE_GPU=1 python -c "import fakegpu; fakegpu.enable()"
python -c "import torch, deepspeed, megatron.core; print(f'installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}, megatron-core {megatron.core.__version__} (pip log: $log)')" 2>&1 | tail -1
