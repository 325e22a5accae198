#!/usr/bin/env bash
# The GPU check, run on the GPU machine from the folder tools/gpu/prepare.sh made (no network needed):
#   1. install: a venv on top of the image's Python that sees the image's packages, the carried
#      wheels (ours and the CPU test device's, bert-fakegpu) installed into it without touching
#      torch; pip's consistency check of ours;
#   2. benchmark (first: speed on the GPU is what a short GPU window is most often for):
#      tools/gpu/bench.py (ModernBERT-base at seq 1024 and 8192, padded and packed, against
#      transformers' ModernBertForMaskedLM; then BERT-large and BERT-base, bf16, seq 128 and 512:
#      ours with LAMB at ZeRO-0/1 and packed, Hugging Face's BertForPreTraining, the planner's
#      prediction);
#   3. GPU tier: REQUIRE_GPU=<GPUs found> pytest -m gpu (tests needing more GPUs than the machine
#      has are skipped with their reason), junit XML and log.
# Each part has its own time budget and is stopped when it overruns; the next part still runs.
# One summary line per part on stdout (and in OUT_DIR/summary.txt). Exit 0 when every part passed.
#
# usage: bash KIT_DIR/check.sh KIT_DIR OUT_DIR
#   GPU_CHECK_PYTHON        the image's Python (default python3)
#   GPU_CHECK_PARTS         which parts after the install, in this order (default "bench,tier")
#   GPU_CHECK_TIER_S        the GPU tier's budget in seconds (default 300)
#   GPU_CHECK_TIER_K        a pytest -k expression narrowing the tier (a rerun of what a budget cut)
#   GPU_CHECK_BENCH_S       the benchmark's budget in seconds (default 240)
#   GPU_CHECK_BENCH_ARGS    more arguments for bench.py (CI's rehearsal: tiny models, fp32)
#   BERT_FAKE_GPU=1         no GPU: the CPU test device stands in (CI's rehearsal)
set -uo pipefail

[ $# -eq 2 ] || { echo "usage: bash KIT_DIR/check.sh KIT_DIR OUT_DIR" >&2; exit 2; }
KIT=$(cd "$1" && pwd) || exit 2
if [ -n "$(ls -A "$2" 2>/dev/null)" ]; then  # never write over what is there
  echo "check.sh: $2 exists and is not empty; give a new folder for the results" >&2
  exit 2
fi
mkdir -p "$2" && OUT=$(cd "$2" && pwd) || exit 2
PY=${GPU_CHECK_PYTHON:-python3}
PARTS=${GPU_CHECK_PARTS:-bench,tier}
TIER_S=${GPU_CHECK_TIER_S:-300}
BENCH_S=${GPU_CHECK_BENCH_S:-240}
read -r -a BENCH_ARGS <<< "${GPU_CHECK_BENCH_ARGS:-}"
# the GPU machine has no network: nothing may wait for a hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SUMMARY=$OUT/summary.txt
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VENV=$WORK/venv
VPY=$VENV/bin/python
START=$(date +%s)
FAILED=()
: > "$SUMMARY"

say() { echo "gpu-check: $*" | tee -a "$SUMMARY"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

# ------------------------------------------------------------------------------------ 1. install
part=$(date +%s)
install() {
  "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
  # The image's own Python may itself be a venv, whose packages --system-site-packages does not
  # show: its site folders are added to ours (site.addsitedir: their .pth files count too).
  local venv_site
  venv_site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  "$PY" -c 'import site; [print(f"import site; site.addsitedir({p!r})") for p in site.getsitepackages()]' \
    > "$venv_site/_gpu_check_image.pth" || return 1
  # the image's pip, run by our venv's Python, installs into the venv; --no-deps: torch and the rest
  # of the image stay as they are
  "$VPY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check -q "$KIT"/wheels/*.whl \
    || return 1
  # their bytecode, on every core at once (pip compiles one file after another): where
  # PYTHONDONTWRITEBYTECODE is set, each benchmark child and rank would compile DeepSpeed,
  # megatron-core and ours from source again
  "$VPY" -m compileall -q -j 0 "$venv_site" > /dev/null || return 1
  # from a folder without the sources, so that what is imported is what was installed
  (cd "$WORK" && "$VPY" - "$KIT") <<'EOF' || return 1
import subprocess, sys
from pathlib import Path

kit = Path(sys.argv[1])
import torch, deepspeed, megatron.core, transformers, pretrain, finetune, fakegpu  # noqa: E401
if sys.prefix in torch.__file__:
    sys.exit(f"torch was installed into the check's venv ({torch.__file__}); the image's torch must stay")
for module in (deepspeed, megatron.core, pretrain, fakegpu):
    if sys.prefix not in module.__file__:
        sys.exit(f"{module.__name__} comes from {module.__file__}, not from the carried wheels")
# pip's view of what the carried wheels need: every requirement of ours must be met, except the
# packages prepare.sh names as not carried
ours = {Path(w).name.split("-")[0].lower().replace("_", "-") for w in (kit / "wheels").glob("*.whl")}
tolerated = set((kit / "not-carried.txt").read_text().split())
report = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                        capture_output=True, text=True).stdout.splitlines()
problems = [line for line in report if line.split(" ")[0].lower().replace("_", "-") in ours
            and not any(f" requires {name}," in line for name in tolerated)]
if problems:
    sys.exit("requirements of the carried wheels not met:\n  " + "\n  ".join(problems))
print(f"torch {torch.__version__} (image, CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, "
      f"Python {sys.version.split()[0]}")
EOF
}
if install > "$OUT/install.log" 2>&1; then
  say "install: ok ($(tail -1 "$OUT/install.log")), $(elapsed "$part")"
else
  say "install: FAILED, $(elapsed "$part"); the end of install.log:"
  tail -20 "$OUT/install.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  exit 1
fi

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$VPY" -m pip list --disable-pip-version-check 2>/dev/null
} > "$OUT/environment.txt" 2>&1

GPUS=$("$VPY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
GPUS=${GPUS:-0}
if [ "$GPUS" -gt 0 ]; then
  say "device: $GPUS GPU(s): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
        | paste -sd ';')"
  TIER=(-m gpu tests)
  TIER_ENV=(REQUIRE_GPU="$GPUS")
elif [ "${BERT_FAKE_GPU:-0}" = 1 ]; then
  say "device: no GPU; the CPU test device (BERT_FAKE_GPU=1) stands in"
  # one scenario on fakegpu and its CUDA twin (skipped with its reason here): the tier runs from the kit
  TIER=(tests/test_engine_construction.py -k "fp16_takes_no_step and lamb-1")
  TIER_ENV=(REQUIRE_GPU=0)
else
  say "device: no GPU found (torch.cuda.device_count() = 0) and BERT_FAKE_GPU is not 1"
  TIER=(-m gpu tests)
  TIER_ENV=(REQUIRE_GPU=1)  # every GPU test fails, by name
fi

[ -n "${GPU_CHECK_TIER_K:-}" ] && TIER+=(-k "$GPU_CHECK_TIER_K")

# ------------------------------------------------------------------------------------ GPU tier
junit_counts() {  # "N passed, N failed, N errors, N skipped; failing: ..." of a junit XML
  "$VPY" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as error:
    print(f"no junit XML ({error})")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
count = lambda key: sum(int(s.get(key, 0)) for s in suites)  # noqa: E731
failed = [f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}" for s in suites for case in s
          if case.find("failure") is not None or case.find("error") is not None]
passed = count("tests") - count("failures") - count("errors") - count("skipped")
print(f"{passed} passed, {count('failures')} failed, {count('errors')} errors, {count('skipped')} skipped"
      + (f"; failing: {', '.join(failed)}" if failed else ""))
EOF
}

run_tier() {
  local part rc tier
  part=$(date +%s)
  # BERT_FAKE_GPU stays out of the tests' environment: each scenario sets its device itself
  (cd "$KIT/src" && env -u BERT_FAKE_GPU "${TIER_ENV[@]}" PYTHONUNBUFFERED=1 timeout -s INT -k 30 "$TIER_S" \
     "$VPY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$OUT/gpu-tier.xml" "${TIER[@]}") \
     > "$OUT/gpu-tier.log" 2>&1
  rc=$?
  tier=$(junit_counts "$OUT/gpu-tier.xml")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; then
    say "GPU tier: STOPPED at its ${TIER_S} s budget: $tier (gpu-tier.log, gpu-tier.xml)"
    FAILED+=("GPU tier")
  elif [ "$rc" -ne 0 ]; then
    say "GPU tier: FAILED (pytest exit $rc): $tier, $(elapsed "$part") (gpu-tier.log, gpu-tier.xml)"
    FAILED+=("GPU tier")
  else
    say "GPU tier: ok: $tier, $(elapsed "$part")"
  fi
}

# ------------------------------------------------------------------------------------ benchmark
run_bench() {
  local part rc line
  part=$(date +%s)
  (cd "$KIT/src" && PYTHONUNBUFFERED=1 timeout -s TERM -k 30 $((BENCH_S + 60)) \
     "$VPY" tools/gpu/bench.py --budget-s "$BENCH_S" --json "$OUT/bench.json" "${BENCH_ARGS[@]}") \
     > "$OUT/bench.log" 2>&1
  rc=$?
  grep -E "^(calibration|BERT-large seq|modernbert-[a-z]+ seq)" "$OUT/bench.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  line=$(grep -E "^gpu bench:" "$OUT/bench.log" | tail -1)
  if [ "$rc" -eq 0 ]; then
    say "benchmark: ok: ${line#gpu bench: } (bench.json, bench.log)"
  else
    say "benchmark: FAILED (exit $rc): ${line:-no result line}, $(elapsed "$part"); the end of bench.log:"
    tail -15 "$OUT/bench.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    FAILED+=("benchmark")
  fi
}

IFS=, read -r -a ORDER <<< "$PARTS"
for part_name in "${ORDER[@]}"; do
  case "$part_name" in
    tier) run_tier ;;
    bench) run_bench ;;
    *) say "unknown part '$part_name' in GPU_CHECK_PARTS (tier, bench)"; FAILED+=("$part_name") ;;
  esac
done

if [ ${#FAILED[@]} -eq 0 ]; then
  say "all parts passed in $(elapsed "$START")"
  exit 0
fi
say "failed: ${FAILED[*]} ($(elapsed "$START") in all)"
exit 1
