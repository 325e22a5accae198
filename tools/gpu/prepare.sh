#!/usr/bin/env bash
# Prepare the GPU check kit on a machine with the package index: every wheel the project needs that
# the GPU machine's image lacks (for its Python, manylinux x86_64), the project's own wheel and that of
# the tests' CPU test device (bert-fakegpu, tests/bert-fakegpu/: CI's rehearsal stands it in for the
# GPU), the tests, configs and tools, and the runner (check.sh). Copy OUT_DIR to the GPU machine and run
#   bash OUT_DIR/check.sh OUT_DIR RESULTS_DIR
# docs/gpu.md: "Checking a GPU machine in ten minutes".
#
# usage: tools/gpu/prepare.sh OUT_DIR
#   GPU_KIT_PYTHON_VERSION   the GPU image's Python (default 3.12); CI's rehearsal gives its own
#   GPU_KIT_LIMIT_MIB        the most the folder may weigh (default 64: what the GPU machine takes)
set -euo pipefail

usage() { echo "usage: tools/gpu/prepare.sh OUT_DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=$1
PYTHON_VERSION=${GPU_KIT_PYTHON_VERSION:-3.12}
LIMIT_MIB=${GPU_KIT_LIMIT_MIB:-64}
PY=${PYTHON:-python3}

# What the GPU image already holds (python3 there has them installed): the kit does not carry these,
# and CI's rehearsal builds its stand-in image from this list. Update it when the image changes.
IMAGE_PACKAGES=(
  torch transformers tokenizers safetensors tensorboard accelerate mpi4py pytest pytest-timeout
  numpy scipy scikit-learn pyyaml tqdm rich psutil matplotlib packaging typing-extensions
  einops msgpack ninja py-cpuinfo nvidia-ml-py
)
# Carried as published wheels for the image's Python (pinned: the versions CI installs).
WHEELS=(
  megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  hjson==3.1.0 blingfire==0.1.8 zstandard==0.25.0
)
# Published as source only: built into wheels here (deepspeed without its compiled ops, as pip builds
# it everywhere; ops compile on first use and the project uses none).
BUILT=(deepspeed==0.19.8 seqeval==1.2.2)
# Declared by the project but not carried, with the reason (check.sh tolerates exactly these missing):
#   mpich: 13 MB, over the folder's limit with the rest; the image's mpi4py brings its own MPI and the
#          check launches nothing through mpirun.
NOT_CARRIED=(mpich)

if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "prepare.sh: $OUT exists and is not empty; give a new folder" >&2
  exit 2
fi
mkdir -p "$OUT/wheels" "$OUT/src"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# the files of the working tree that git knows or would add (a file deleted but not committed is left out)
sources() {
  (cd "$REPO" && git ls-files -co --exclude-standard -- "$@" | while IFS= read -r f; do [ ! -e "$f" ] || echo "$f"; done)
}

echo "prepare.sh: wheels for CPython $PYTHON_VERSION manylinux x86_64"
TARGET=(--only-binary=:all: --no-deps --implementation cp --python-version "$PYTHON_VERSION"
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
"$PY" -m pip download -q "${TARGET[@]}" -d "$OUT/wheels" "${WHEELS[@]}"
for pkg in "${BUILT[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" "$pkg"
done
# the project's wheel and the test device's, built from a copy of the sources (setuptools writes build/
# beside what it builds)
mkdir -p "$WORK/source"
sources | (cd "$REPO" && tar -cf - -T -) | tar -xf - -C "$WORK/source"
"$PY" -m pip wheel -q --no-deps -w "$WORK/project" "$WORK/source" "$WORK/source/tests/bert-fakegpu"
cp "$WORK"/project/bert_pretrain-*.whl "$WORK"/project/bert_fakegpu-*.whl "$OUT/wheels/"

# The parts of the repository that are not in the wheels: tests, tools (the benchmark and the check),
# configs, the launcher. The library and the test device come from their wheels.
sources tests tools configs launcher.sh pyproject.toml setup.cfg ':(exclude)tests/bert-fakegpu' \
  | (cd "$REPO" && tar -cf - -T -) | tar -xf - -C "$OUT/src"
cp "$REPO/tools/gpu/check.sh" "$OUT/check.sh"
printf '%s\n' "${IMAGE_PACKAGES[@]}" > "$OUT/image-packages.txt"
printf '%s\n' "${NOT_CARRIED[@]}" > "$OUT/not-carried.txt"
(cd "$REPO" && git rev-parse HEAD 2>/dev/null && git status --porcelain | head -20) > "$OUT/source-revision.txt" || true

echo "prepare.sh: $OUT"
(cd "$OUT/wheels" && ls -l *.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $9}')
size_kib=$(du -sk "$OUT" | cut -f1)
awk -v k="$size_kib" -v limit="$LIMIT_MIB" 'BEGIN { printf "prepare.sh: %.1f MiB in all (limit %s MiB)\n", k / 1024, limit }'
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "prepare.sh: the kit is over ${LIMIT_MIB} MiB: the GPU machine will not take it" >&2
  exit 1
fi
