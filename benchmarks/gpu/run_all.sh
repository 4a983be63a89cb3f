#!/usr/bin/env bash
# The GPU battery, one call (about 9 minutes on one H100): correctness on the device, kernel tuning and
# the kernel benchmark, end-to-end training against the peers, and the planner check; every result as
# JSON under one folder, then a table of the targets and one closing line. Steps run in order and each
# writes its results before the next starts, so a run cut off keeps what it finished.
#
#     benchmarks/gpu/run_all.sh [OUT_DIR]        # default $OUT (the device tool's), else benchmarks/results/gpu
#     benchmarks/gpu/run_all.sh --dry-run [DIR]  # on a CPU: the steps that can run there, tiny (CI)
#
# Installs nothing from the network. Where DeepSpeed is missing (the GPU image has none) it installs the
# wheels of `.gpu-kit/` (built here with ../shared/gpu/make-kit.sh .gpu-kit, carried along) into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export BENCH_RESULTS="$out"
py=${PYTHON:-python3}

if ! $py -c "import deepspeed" 2>/dev/null; then
    if ls .gpu-kit/*.whl >/dev/null 2>&1; then
        $py -m pip install -q --no-index --no-deps --target /tmp/site .gpu-kit/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        $py -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
    else
        echo "run_all.sh: DeepSpeed is not installed and there is no .gpu-kit/ to install it from" >&2
        exit 2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cuda=$($py -c "import torch; print(int(torch.cuda.is_available()))")
if [[ $cuda == 0 && $dry == 0 ]]; then
    echo "run_all.sh: no CUDA device here; --dry-run runs what a CPU can" >&2
    exit 2
fi

step() {  # step NAME COMMAND...: its output in NAME.log, its status and time in NAME.status.json
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" > "$out/$name.status.json"
    tail -n 4 "$out/$name.log"
    [[ $rc == 0 ]] || echo "== $name failed (rc $rc): see $out/$name.log"
}

step correctness $py -m pytest -m gpu -q -p no:cacheprovider --junitxml "$out/correctness.xml" tests/test_gpu.py
if [[ $cuda == 1 ]]; then
    step tune $py benchmarks/tune_moe_kernels.py --write
    cp ops/tuned_blocks.json "$out/" 2>/dev/null
    step kernels $py benchmarks/moe_kernels.py --tokens 8192,16384
fi
if [[ $dry == 1 ]]; then
    step e2e $py benchmarks/gpu/train_e2e.py --dry-run
    mv "$out/train_e2e_dry_run.json" "$out/train_e2e.json" 2>/dev/null
else
    step e2e $py benchmarks/gpu/train_e2e.py ${E2E_ARGS:-}
fi
$py benchmarks/gpu/summary.py "$out"
