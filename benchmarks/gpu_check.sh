#!/usr/bin/env bash
# The one script for the lent GPU machine (H200): build jaxfuse with its CUDA
# kernel, run the GPU tests, run the full benchmark.  Everything goes to $OUT:
#   env.txt          GPU, driver, python, jax, where jaxfuse was imported from, kernels(),
#                    the vector kernels' global loads/stores by width (SASS)
#   build.log        pip install --no-build-isolation (JAXFUSE_CUDA=ON)
#   pytest_gpu.log   python -m pytest -m gpu
#   bench.log        one progress line per case (ratio to XLA, verdict), then
#                    the table and verdicts (a timeout leaves the progress lines),
#                    then the thresholds and the issue's bar read off the op sweep
#                    (benchmarks/thresholds.py --from-bench: no extra device time)
#   bench_gpu.json   all measurements, both timing modes (rewritten after every
#                    group, so a timeout still leaves what was measured;
#                    "complete": false then)
#   bench_gpu.png    GB/s vs size with the reference-copy roofline, and the
#                    model workloads' time ratios to XLA with their 95% intervals
#   variants.txt     benchmarks/probes/cuda_variants.py: each add+ReLU kernel variant's GB/s
#                    and time ratio to XLA, and its bits checked against XLA's;
#                    last, the fastest variant per dtype and form (the default to make)
#   summary.txt      one line per step: ok / FAILED
#
# Nothing can be downloaded there: the build uses the image's own jax, nanobind,
# scikit-build-core, cmake and ninja (no build isolation, no dependency resolution).
# Python packages the image lacks (dm-haiku, for the haiku workloads) travel as
# wheels in .whl/ (git-ignored), named in the device call's `carry`; the script
# installs whatever .whl/ holds, without an index. To fetch them here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl dm-haiku jmp
# Budget: the whole script must end within ~8 minutes (TOTAL_BUDGET_S, default
# 450 s); the benchmark gets what the build and the tests left, less the
# VARIANTS_S (default 75 s) kept for the kernel variants, at most 240 s.
# To fit, it runs 30 repetitions (not 50) and the op sweep at 8 sizes (every
# power of 2 from 2^22, around the issue's bar at 2^24 and up; every other one
# below, which is as fine as the thresholds read off the sweep get). The op sweep of every dtype runs before the models,
# so a run out of time loses models (the long compiles), not the sweep the
# thresholds come from. Each model runs in float32 and bfloat16 (MODEL_DTYPES;
# cuDNN's fused attention takes 16-bit inputs only) before the next, in
# WORKLOADS' order: first those the GPU issue names (ResNet-50 and the flax
# CNN, where fusing everything lost, and the attention model), the haiku ones
# last (the image has no dm-haiku unless it is carried as a wheel). Extra
# benchmark flags go in BENCH_ARGS (later flags win).
# Exit status: 0 only if the build, the GPU tests and the benchmark all passed;
# a failed build or failed tests do not stop the later steps.
#
# Usage (repository root or anywhere):  OUT=/some/dir bash benchmarks/gpu_check.sh
# Knobs: PYTHON (default python3), INSTALL_TARGET (install with --target there
# instead of into the environment), JAXFUSE_CUDA (default ON), TOTAL_BUDGET_S,
# BUILD_TIMEOUT_S, TEST_TIMEOUT_S, BENCH_MAX_S, SWEEP_SIZES (the op sweep's sizes),
# WORKLOADS (the benchmark's, in run order), MODEL_DTYPES,
# BENCH_ARGS (extra benchmark flags),
# VARIANTS_S (0 skips the variants).
# Syntax check on any machine:          bash -n benchmarks/gpu_check.sh
set -euo pipefail

if [[ -z "${OUT:-}" ]]; then
  echo "gpu_check.sh: set OUT to the output folder (e.g. OUT=/tmp/out bash benchmarks/gpu_check.sh)" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TOTAL_BUDGET_S="${TOTAL_BUDGET_S:-450}"
BUILD_TIMEOUT_S="${BUILD_TIMEOUT_S:-240}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-120}"
BENCH_MAX_S="${BENCH_MAX_S:-240}"
VARIANTS_S="${VARIANTS_S:-75}"
SWEEP_SIZES="${SWEEP_SIZES:-2^16,2^18,2^20,2^22,2^23,2^24,2^25,2^26}"
MODEL_DTYPES="${MODEL_DTYPES:-float32,bfloat16}"
WORKLOADS="${WORKLOADS:-add_relu,bias_add_relu,stax_resnet50,flax_cnn,linen_attention,hf_bert_encoder,hf_gpt2_decoder,hf_bert_train,hf_gpt2_train,resnet_block,eqx_nchw_conv,dense_relu,scale_shift,relu_add,linen_ffn_train,eqx_mlp_train,mlp_train_step,mlp,haiku_resnet_eval,haiku_resnet50_eval,haiku_resnet_train,llama_train,gpt2_train,llama_train_128k,gpt2_train_128k}"
INSTALL_TARGET="${INSTALL_TARGET:-}"  # set: pip install --target there (leaves the environment untouched)
export PYTHONUNBUFFERED=1  # logs survive a timeout
T0=$SECONDS
STATUS=0
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME RC
  if [[ "$2" -eq 0 ]]; then
    echo "$1: ok" | tee -a "$SUMMARY"
  else
    echo "$1: FAILED (exit $2)" | tee -a "$SUMMARY"
    STATUS=1
  fi
}

# Run everything Python from a scratch folder, never the repository root: there
# `python -m ...` would put the source tree (which has no compiled kernels) ahead
# of the installed package on sys.path.
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# ------------------------------------------------------------------ environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo: $REPO  commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "--- nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 || echo "nvidia-smi failed"
  echo "--- python"
  command -v "$PY" || true
  "$PY" --version 2>&1 || echo "$PY: not found"
  echo "--- jax"
  (cd "$WORK" && "$PY" -c 'import jax; print(jax.__version__, jax.devices())') 2>&1 || echo "jax import failed"
  echo "--- build tools"
  "$PY" -c 'import nanobind, scikit_build_core; print("nanobind", nanobind.__version__, "scikit-build-core", scikit_build_core.__version__)' 2>&1 || true
  cmake --version 2>&1 | head -1 || echo "cmake: not found"
  ninja --version 2>&1 || echo "ninja: not found"
  nvcc --version 2>&1 | tail -2 || echo "nvcc: not found"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ------------------------------------------------------- carried wheels (.whl/)
shopt -s nullglob
WHEELS=("$REPO"/.whl/*.whl)
shopt -u nullglob
if (( ${#WHEELS[@]} )); then
  set +e
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/wheels" "${WHEELS[@]}" \
    >>"$OUT/env.txt" 2>&1
  WHEELS_RC=$?
  set -e
  export PYTHONPATH="$WORK/wheels${PYTHONPATH:+:$PYTHONPATH}"
  echo "carried wheels: ${WHEELS[*]##*/} (pip exit $WHEELS_RC)" | tee -a "$OUT/env.txt"
fi

# ------------------------------------------------------------------------ build
BUILD_RC=0
if ! "$PY" -c "import nanobind, scikit_build_core" >/dev/null 2>&1; then
  echo "ERROR: the build needs nanobind and scikit-build-core in $PY's environment" \
       "(pip install --no-build-isolation cannot fetch them here: nothing can be downloaded)." \
       "Carry them as wheels or use a python that has them (PYTHON=...)." | tee "$OUT/build.log" >&2
  BUILD_RC=3
else
  export JAXFUSE_CUDA="${JAXFUSE_CUDA:-ON}"
  set +e
  if [[ -n "$INSTALL_TARGET" ]]; then
    (cd "$REPO" && timeout "$BUILD_TIMEOUT_S" "$PY" -m pip install --no-build-isolation --no-deps \
       --target "$INSTALL_TARGET" -v . ) >"$OUT/build.log" 2>&1
    BUILD_RC=$?
    export PYTHONPATH="$INSTALL_TARGET${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$INSTALL_TARGET/bin:$PATH"
  else
    (cd "$REPO" && timeout "$BUILD_TIMEOUT_S" "$PY" -m pip install --no-build-isolation --no-deps -v . ) \
      >"$OUT/build.log" 2>&1
    BUILD_RC=$?
  fi
  if [[ $BUILD_RC -ne 0 && -z "$INSTALL_TARGET" ]] && grep -qiE "permission denied|not writeable|read-only" "$OUT/build.log"; then
    # The image's site-packages is not writable: install into a private folder.
    echo "--- retrying with --target $WORK/site" >>"$OUT/build.log"
    (cd "$REPO" && timeout "$BUILD_TIMEOUT_S" "$PY" -m pip install --no-build-isolation --no-deps \
       --target "$WORK/site" -v . ) >>"$OUT/build.log" 2>&1
    BUILD_RC=$?
    if [[ $BUILD_RC -eq 0 ]]; then
      export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
      export PATH="$WORK/site/bin:$PATH"
    fi
  fi
  set -e
  tail -n 25 "$OUT/build.log"
fi
step build "$BUILD_RC"
if [[ $BUILD_RC -ne 0 ]]; then
  # Still measure XLA and the unfused path; the benchmark labels the jaxfuse
  # mode FALLBACK loudly when no kernel is there.
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

(cd "$WORK" && "$PY" -c '
import jaxfuse, jaxfuse.ops.kernels as k
print("jaxfuse imported from", jaxfuse.__file__)
print("kernels()", jaxfuse.kernels(), "| cuda:", k.why_not("cuda") or "ok")
') 2>&1 | tee -a "$OUT/env.txt" || true

# SASS (sm_90) of the same-shape vector kernels: 16-byte LDG/STG? Appended to
# env.txt with the module read and the exit status (2: no cuobjdump, 1: no kernel
# matched, 124: timed out).
set +e
SO="$(cd "$WORK" && timeout 60 "$PY" -c 'import jaxfuse._cuda_kernels as m; print(m.__file__)' 2>/dev/null)"
if [[ -n "$SO" ]]; then
  (cd "$WORK" && timeout 60 "$PY" "$REPO/benchmarks/probes/vector_access.py" --so "$SO" --arch sm_90 \
     --match ", 0, 0") >>"$OUT/env.txt" 2>&1
  echo "SASS: exit $?" >>"$OUT/env.txt"
else
  echo "SASS: not read (no CUDA module imports)" >>"$OUT/env.txt"
fi
set -e

# ------------------------------------------------------------------------ tests
set +e
(cd "$WORK" && timeout "$TEST_TIMEOUT_S" "$PY" -m pytest "$REPO/tests" -m gpu -q -rs -p no:cacheprovider) \
  >"$OUT/pytest_gpu.log" 2>&1
TEST_RC=$?
set -e
tail -n 25 "$OUT/pytest_gpu.log"
step "pytest -m gpu" "$TEST_RC"

# -------------------------------------------------------------------- benchmark
LEFT=$(( TOTAL_BUDGET_S - (SECONDS - T0) - 15 - VARIANTS_S ))
(( LEFT > BENCH_MAX_S )) && LEFT=$BENCH_MAX_S
(( LEFT < 60 )) && LEFT=60
echo "benchmark: ${LEFT}s budget"
# The benchmark is a package of its own (benchmarks/jaxfuse_bench), run from the checkout.
export PYTHONPATH="$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
BENCH=("$PY" -m jaxfuse_bench)
set +e
# stderr is a file here, so the progress comes as one line per case.
# --time-budget: no new case after LEFT-60 s (a model case's compiles can take
# that long; half of LEFT when it is short), so the run still prints its table and writes the plot; the
# timeout only catches a case that runs longer (ResNet-50 above all).
# shellcheck disable=SC2086
(cd "$WORK" && timeout "$LEFT" "${BENCH[@]}" --timing latency,throughput --reps 30 \
   --workloads "$WORKLOADS" --sizes "$SWEEP_SIZES" --model-dtypes "$MODEL_DTYPES" --time-budget "$(( LEFT > 120 ? LEFT - 60 : LEFT / 2 ))" ${BENCH_ARGS:-} \
   --json "$OUT/bench_gpu.json" --plot "$OUT/bench_gpu.png") >"$OUT/bench.log" 2>&1
BENCH_RC=$?
set -e
tail -n 80 "$OUT/bench.log"
step "benchmark (exit 124 = timed out; partial JSON kept)" "$BENCH_RC"

# The CUDA thresholds and the issue's bar, read off the sweep just written (no
# timing: seconds of host time), so one call yields the cost model's entries.
if [[ -s "$OUT/bench_gpu.json" ]]; then
  set +e
  (cd "$WORK" && timeout 60 "$PY" "$REPO/benchmarks/thresholds.py" --from-bench "$OUT/bench_gpu.json") \
    >>"$OUT/bench.log" 2>&1
  THRESH_RC=$?
  set -e
  tail -n 40 "$OUT/bench.log"
  step "thresholds read off the sweep" "$THRESH_RC"
fi

# ------------------------------------------------------------- kernel variants
if (( VARIANTS_S > 0 )) && [[ $BUILD_RC -eq 0 ]]; then
  set +e
  (cd "$WORK" && timeout "$VARIANTS_S" "$PY" "$REPO/benchmarks/probes/cuda_variants.py" --reps 11 \
     --out "$OUT/variants.txt") >"$WORK/variants.log" 2>&1
  VARIANTS_RC=$?
  set -e
  # A timeout leaves no --out file: keep the progress lines instead.
  [[ -s "$OUT/variants.txt" ]] || cp "$WORK/variants.log" "$OUT/variants.txt"
  tail -n 60 "$OUT/variants.txt"
  step "kernel variants (exit 1 = a variant's bits differ from XLA's)" "$VARIANTS_RC"
fi

echo "elapsed: $(( SECONDS - T0 ))s" | tee -a "$SUMMARY"
cat "$SUMMARY"
exit "$STATUS"
