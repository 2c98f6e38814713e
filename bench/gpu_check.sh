#!/usr/bin/env bash
# One prepared check of k3rl on a single-GPU machine (an H200 of the workplace's device tool): the CUDA tests,
# the Triton kernels against the PyTorch paths on CUDA, KDA against flash-linear-attention, a whole tiny-K3
# learner step and decode through the Triton paths. One summary file (gpu_check.md) beside the step logs.
#
# The GPU image has torch, triton, transformers, safetensors, numpy, pytest, but no vLLM, Ray or OmegaConf, and no
# network: the pure-Python packages the steps need (bench/gpu_wheels.txt) travel beside the script as wheels.
#
#   bench/gpu_check.sh --fetch-wheels     # here, with a network: download the wheels into .gpu-wheels/ (ignored)
#   bench/gpu_check.sh --dry-run          # here, on the CPU: every step's imports (GPU-only packages blocked),
#                                         # test collection and the bench scripts' CPU smoke modes; no GPU needed
#   bench/gpu_check.sh                    # on the GPU machine; results in $OUT (else bench/out/gpu_check)
#
# With the device tool: run(command="bash bench/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=540).
# Each step has its own time limit (STEP_LIMITS below, ~7 min together); a step that fails or runs out of time
# is recorded and the next one runs. Exit status: 0 when every step passed, 1 otherwise. GPU_CHECK_STEPS="env pytest"
# runs a subset (a rerun after a fix, within the lease).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE=run
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: bench/gpu_check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac
WHEELS="$ROOT/.gpu-wheels"
PY="${PYTHON:-python3}"

if [[ $MODE == fetch ]]; then
  mkdir -p "$WHEELS"
  grep -v '^#' bench/gpu_wheels.txt | grep . | xargs "$PY" -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" || exit 1
  ls -l "$WHEELS"
  exit 0
fi

if [[ $MODE == dry ]]; then
  RESULTS="${OUT:-$ROOT/bench/out/gpu_check_dry}"
else
  RESULTS="${OUT:-$ROOT/bench/out/gpu_check}"
fi
# Steps write into WORK; RESULTS gets five files (the device tool brings back at most eight): gpu_check.md (the
# summary and every table), gpu_check.log (every step's whole output), kda_gpu.json, gpu_model.json, pytest.xml.
WORK="${TMPDIR:-/tmp}/k3rl-gpu-check-$MODE"
rm -rf "$WORK" && mkdir -p "$WORK" "$RESULTS"
LOG="$RESULTS/gpu_check.log"
SUMMARY="$RESULTS/gpu_check.md"
: >"$LOG"

# The CUDA tests: every test of the repository that needs a GPU and can run without vLLM.
# (tests/rollout/test_vllm_k3_gpu.py needs vLLM's CUDA build: its wheels exceed what travels to the machine.)
GPU_TESTS="tests/kernels/test_cuda_parity.py tests/kernels/test_situ.py tests/kernels/test_attn_res_mix.py"
# step name → time limit (seconds); their sum stays under 8 minutes with the setup
declare -A STEP_LIMITS=([env]=40 [pytest]=150 [kda_gpu]=300 [gpu_model]=220)
read -r -a STEPS <<<"${GPU_CHECK_STEPS:-env pytest kda_gpu gpu_model}"  # GPU_CHECK_STEPS="env gpu_model": a subset
for s in "${STEPS[@]}"; do
  [[ -n "${STEP_LIMITS[$s]:-}" ]] || { echo "GPU_CHECK_STEPS: unknown step '$s'; the steps are: env pytest kda_gpu gpu_model" >&2; exit 2; }
done

# k3rl without installing: the namespace package `k3rl` as links to the repository's top-level folders
# (what pyproject's package-dir maps), plus the carried wheels unpacked beside it.
SITE="${TMPDIR:-/tmp}/k3rl-gpu-site"
rm -rf "$SITE" && mkdir -p "$SITE/k3rl"
for pkg in envs kernels model rl rollout util; do ln -s "$ROOT/$pkg" "$SITE/k3rl/$pkg"; done
if [[ $MODE == run ]]; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
      >>"$LOG" 2>&1 || echo "wheel install failed (see gpu_check.log)" | tee -a "$LOG"
  else
    echo "no wheels in $WHEELS (bench/gpu_check.sh --fetch-wheels, then carry .gpu-wheels)" | tee -a "$LOG"
  fi
fi
export PYTHONPATH="$SITE:$ROOT/tests/model${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# On the CPU, the dry run blocks the packages the GPU image lacks, so an import that would fail there fails here.
BLOCK="$WORK/block"
mkdir -p "$BLOCK"
cat >"$BLOCK/sitecustomize.py" <<'EOF'
import sys
for name in ("ray", "vllm", "trl", "datasets", "bm25s", "faiss", "openai", "sentence_transformers"):
    sys.modules[name] = None  # `import name` raises ImportError, as on the GPU image
EOF

step_cmd() {  # the command of a step, in run or dry mode
  case "$1:$MODE" in
    env:run) echo "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv && \
$PY -c 'import torch, triton, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"triton\", triton.__version__, \"transformers\", transformers.__version__); print(torch.cuda.get_device_name())' && \
$PY -c 'import fla, omegaconf; print(\"fla\", fla.__version__, \"omegaconf\", omegaconf.__version__)'" ;;
    env:dry) echo "PYTHONPATH=$BLOCK:\$PYTHONPATH $PY -c 'import torch, triton, k3rl.kernels.kda, k3rl.kernels.moe, \
k3rl.model.modeling, k3rl.rollout.torch_engine; print(\"imports ok\")'" ;;
    pytest:run) echo "$PY -m pytest ${GPU_TESTS_SELECTED:-$GPU_TESTS} -q -p no:cacheprovider -o addopts= --timeout=140 \
--junitxml=$WORK/pytest.xml -rfEs" ;;
    pytest:dry) echo "PYTHONPATH=$BLOCK:\$PYTHONPATH $PY -m pytest $GPU_TESTS -q -p no:cacheprovider -o addopts= \
--collect-only" ;;
    kda_gpu:run) echo "$PY bench/kda_gpu.py ${KDA_GPU_ARGS:---shapes 1x4096,1x32768,1x131072} --out $WORK" ;;
    kda_gpu:dry) echo "PYTHONPATH=$BLOCK:\$PYTHONPATH $PY bench/kda_gpu.py --smoke-cpu --out $WORK" ;;
    gpu_model:run) echo "$PY bench/gpu_model.py ${GPU_MODEL_ARGS:-} --out $WORK" ;;
    gpu_model:dry) echo "PYTHONPATH=$BLOCK:\$PYTHONPATH $PY bench/gpu_model.py --smoke-cpu --out $WORK" ;;
  esac
}

declare -A STATUS SECONDS_TAKEN
for s in "${STEPS[@]}"; do STATUS[$s]="not run"; SECONDS_TAKEN[$s]=0; done

write_summary() {  # after every step, so a run cut short still leaves its results
  local s f
  {
    echo "# bench/gpu_check.sh ($MODE mode), $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    for s in "${STEPS[@]}"; do echo "| $s | ${STATUS[$s]} | ${SECONDS_TAKEN[$s]} |"; done
    echo
    for s in "${STEPS[@]}"; do
      if [[ -f "$WORK/$s.md" ]]; then echo "## $s"; cat "$WORK/$s.md"; echo
      elif [[ -f "$WORK/$s.log" ]]; then echo "## $s (last lines)"; echo '```'; tail -n 25 "$WORK/$s.log"; echo '```'; fi
    done
  } >"$SUMMARY"
  for f in kda_gpu.json gpu_model.json pytest.xml; do if [[ -f "$WORK/$f" ]]; then cp "$WORK/$f" "$RESULTS/"; fi; done
}

for s in "${STEPS[@]}"; do
  cmd="$(step_cmd "$s")"
  override="LIMIT_$s"
  limit="${!override:-${STEP_LIMITS[$s]}}"  # LIMIT_pytest=60 etc. override a step's limit
  [[ $MODE == dry ]] && limit=$((limit * 4))  # the interpreter is slow
  echo "=== [$s] (limit ${limit}s) $cmd" | tee -a "$LOG"
  start=$(date +%s)
  STATUS[$s]=running
  write_summary
  timeout --kill-after=10 "$limit" bash -c "$cmd" >"$WORK/$s.log" 2>&1
  rc=$?
  SECONDS_TAKEN[$s]=$(( $(date +%s) - start ))
  cat "$WORK/$s.log" >>"$LOG"
  tail -n 15 "$WORK/$s.log"
  if [[ $rc == 0 ]]; then STATUS[$s]=pass
  elif [[ $rc == 124 || $rc == 137 ]]; then STATUS[$s]="timeout (${limit}s)"
  else STATUS[$s]="fail (exit $rc)"; fi
  echo "=== [$s] ${STATUS[$s]} in ${SECONDS_TAKEN[$s]}s" | tee -a "$LOG"
  write_summary
done
head -n $(( ${#STEPS[@]} + 4 )) "$SUMMARY"
for s in "${STEPS[@]}"; do [[ ${STATUS[$s]} == pass ]] || exit 1; done
exit 0
