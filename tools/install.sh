#!/usr/bin/env bash
# Create ./.venv (if missing) and install the project with its test extras into it, and beside it the
# tests' CPU test device (tests/bert-fakegpu/: the distribution bert-fakegpu, import name fakegpu,
# never part of the product; a pip extra cannot name a folder, so it comes in the same pip command).
# torch is installed first and pinned: on CPU machines pip takes the CPU build lying on disk;
# an unpinned torch would pull a multi-GB CUDA build. GPU users may preinstall their own torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]" -e tests/bert-fakegpu
python -c "import torch, deepspeed, megatron.core; print(f'installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}, megatron-core {megatron.core.__version__}')" 2>&1 | tail -1
