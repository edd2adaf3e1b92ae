#!/usr/bin/env bash
# minivllm GPU check: one call on a fresh CUDA machine (e.g. an H200), ~6 minutes at most.
#
#   bash benchmarks/gpu_check.sh          (from the repository root; `make gpu-check`)
#
# Steps, each time-boxed and non-fatal (a failing step still leaves the final table):
#   0. environment: nvidia-smi, versions, missing Python packages (wheels in .whl/ are
#      installed into /tmp/site if present); a random Llama is built in the background
#   1. pytest -m cuda --backend=fast        the kernels' full CUDA grid (vLLM's shapes, d 64..128)
#   2. pytest -m cuda --backend=fast        the rest of the suite's CUDA tests: the engine end to
#                                           end with CUDA graphs, the sampler, and the features
#                                           together (tests/test_cuda_compose.py)
#   3. python -m minivllm.bench throughput  end to end, --backend ref and fast
#   4. python -m minivllm.bench kernels     ref vs Triton timings, decode GB/s, prefill vs SDPA
#   5. kernel equivalence tests on CUDA     tests/test_attention.py tests/test_small_kernels.py
#   6. summary table (printed last); summary, log, plot and a tarball of results/ go to $OUT
# Budgets (seconds; worst case ~8 minutes in all) can be changed through the environment:
# T_GRID T_BENCH T_E2E (each backend) T_TESTS T_OTHER.
set -u

cd "$(dirname "$0")/.."
ROOT=$PWD
RES=${RESULTS_DIR:-$ROOT/results}
mkdir -p "$RES"
rm -f "$RES"/junit_*.xml "$RES"/e2e_*.json "$RES"/bench_kernels.* "$RES"/steps.txt
START=$(date +%s)
PY=${PYTHON:-python3}
T_GRID=${T_GRID:-100}
T_BENCH=${T_BENCH:-80}
T_E2E=${T_E2E:-50}
T_TESTS=${T_TESTS:-60}
T_OTHER=${T_OTHER:-150}
KERNEL_TESTS=(tests/test_attention.py tests/test_small_kernels.py)
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET

step() {  # step NAME SECONDS CMD...: run time-boxed, record the exit code, never abort
    local name=$1 secs=$2
    shift 2
    echo
    echo "=== [$(( $(date +%s) - START ))s] $name (limit ${secs}s): $*"
    timeout --kill-after=10 "$secs" "$@"
    local rc=$?
    echo "=== $name: exit $rc"
    echo "$name=$rc" >> "$RES/steps.txt"
    return 0
}

main() {
# ---------------------------------------------------------------------------- 0. environment
echo "=== minivllm GPU check, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>/dev/null || echo "nvidia-smi not available"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing carried wheels from .whl/ into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "wheel install failed (continuing)"
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
$PY - <<'PYEOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
missing = []
for name in ["triton", "pytest", "hypothesis", "transformers", "tokenizers", "safetensors",
             "matplotlib", "numpy", "gguf", "xdist"]:
    try:
        m = importlib.import_module(name)
        print(f"  {name:<13}{getattr(m, '__version__', '?')}")
    except Exception as e:
        missing.append(name)
        print(f"  {name:<13}MISSING ({type(e).__name__})")
if missing:
    print("missing packages: " + ", ".join(missing) +
          " (carry wheels in .whl/ to install them; gguf and xdist are optional)")
PYEOF

# The pytest plugin is registered by `pip install -e .`; on a bare machine load it by name.
PLUGIN=()
HAS_PLUGIN="import importlib.metadata as m, sys
sys.exit(0 if any(e.value.startswith('minivllm') for e in m.entry_points(group='pytest11')) else 1)"
if ! $PY -c "$HAS_PLUGIN" 2>/dev/null; then
    PLUGIN=(-p minivllm.testing.pytest_plugin)
fi
XDIST=()
if $PY -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi

# A random model for the end-to-end step, built on the CPU while the GPU runs the tests.
MODEL_DIR=/tmp/minivllm_gpu_check_model
( timeout 120 $PY benchmarks/gpu_check.py make-model "$MODEL_DIR" > "$RES/make_model.log" 2>&1;
  echo "make-model exit $?" >> "$RES/make_model.log" ) &
MODEL_PID=$!
# The C++ CPU ops (the kernel tests' CPU side), built on the machine's cores meanwhile.
( timeout 300 $PY -m minivllm.fast.cpu_ops > "$RES/cpu_ops_build.log" 2>&1;
  echo "cpu_ops build exit $?" >> "$RES/cpu_ops_build.log" ) &

# ---------------------------------------------------------------------------- 1. CUDA grid
step cuda_grid "$T_GRID" $PY -m pytest -q --tb=line -p no:cacheprovider "${PLUGIN[@]}" \
    "${XDIST[@]}" -m cuda --backend=fast "${KERNEL_TESTS[@]}" --junitxml="$RES/junit_cuda.xml"

# ---------------------------------------------------------------------------- 2. other CUDA tests
step other_cuda "$T_OTHER" $PY -m pytest -q --tb=short -p no:cacheprovider "${PLUGIN[@]}" \
    "${XDIST[@]}" --continue-on-collection-errors -m cuda --backend=fast \
    --ignore=tests/test_attention.py --ignore=tests/test_small_kernels.py \
    --junitxml="$RES/junit_other.xml"

# ---------------------------------------------------------------------------- 3. end to end
wait "$MODEL_PID" 2>/dev/null
cat "$RES/make_model.log"
if $PY -m minivllm.bench throughput --help 2>/dev/null | grep -q -- "--backend" \
        && [ -f "$MODEL_DIR/config.json" ]; then
    for b in ref fast; do
        step "e2e_$b" "$T_E2E" $PY -m minivllm.bench throughput --backend "$b" \
            --model "$MODEL_DIR" --dtype bfloat16 --device cuda --num-requests 64 \
            --max-num-seqs 64 --quiet --out "$RES/e2e_$b.json"
    done
else
    echo "=== e2e skipped: no 'python -m minivllm.bench throughput --backend' or no model"
    echo "e2e=skipped" >> "$RES/steps.txt"
fi

# ---------------------------------------------------------------------------- 4. kernel bench
step bench_kernels "$T_BENCH" $PY -m minivllm.bench kernels --out "$RES/bench_kernels.json"

# ---------------------------------------------------------------------------- 5. kernel tests
tail -1 "$RES/cpu_ops_build.log" 2>/dev/null
step kernel_tests "$T_TESTS" $PY -m pytest -q --tb=line -p no:cacheprovider "${PLUGIN[@]}" \
    "${XDIST[@]}" --backend=fast -m "not cuda" "${KERNEL_TESTS[@]}" \
    --junitxml="$RES/junit_kernels.xml"

# ---------------------------------------------------------------------------- 6. summary
echo "total wall time: $(( $(date +%s) - START )) s"
$PY benchmarks/gpu_check.py summary "$RES" > "$RES/summary.txt" 2>&1
cat "$RES/summary.txt"
}

main 2>&1 | tee "$RES/gpu_check.log"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    for f in summary.txt gpu_check.log bench_kernels.png; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"
    done
    tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
fi
exit 0
