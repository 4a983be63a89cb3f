#!/usr/bin/env bash
# The GPU battery, one call (about 7 minutes on one H200): correctness on the device, kernel tuning and
# the kernel benchmark, end-to-end training against the peers, and the planner check; every result as
# JSON under one folder, then a table of the targets and one closing line. Steps run in order and each
# writes its results before the next starts, so a run cut off keeps what it finished; the tuning's
# compilations run in parallel beside the correctness tests (untimed), and the kernel benchmark and
# ours' end-to-end run leave torch.profiler tables of their top kernels beside their JSON.
#
#     benchmarks/gpu/run_all.sh [OUT_DIR]        # default $OUT (the device tool's), else benchmarks/results/gpu
#     benchmarks/gpu/run_all.sh --dry-run [DIR]  # on a CPU: the steps that can run there, tiny (CI)
#
# BATTERY_SECONDS bounds the whole battery (each step gets at most what is left of it, and its own
# cap), so that a lease's time limit ends with the summary written; E2E_ARGS passes arguments to
# train_e2e.py (default: 8 layers, 14 steps, 2 rounds, ours profiled).
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
        $py -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu-kit/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"  # the deepspeed launcher
        # PEP 660 with the installed setuptools: the legacy `setup.py develop` path would fetch setuptools
        $py -m pip install -q --no-index --no-deps --no-build-isolation --use-pep517 -e . >"$out/install.log" 2>&1
        if ! $py -c "import ds_optimus.hf_models, ds_optimus.ops" 2>/dev/null; then
            echo "run_all.sh: the editable install failed ($out/install.log); linking hf_models/ and ops/ into" \
                 "ds_optimus/ for this run" >&2
            ln -sfn ../hf_models ds_optimus/hf_models && ln -sfn ../ops ds_optimus/ops
        fi
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

deadline=$((SECONDS + ${BATTERY_SECONDS:-86400}))
budget() {  # budget CAP: seconds a step may take: CAP, or what is left of the battery's time less 20 s
    local left=$((deadline - SECONDS - 20))
    (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"
}

step() {  # step NAME CAP_S COMMAND...: its output in NAME.log, its status and time in NAME.status.json
    local name=$1 cap; cap=$(budget "$2"); shift 2
    local start=$SECONDS
    echo "== $name (at most ${cap} s): $*"
    timeout --kill-after 10 "$cap" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" > "$out/$name.status.json"
    tail -n 4 "$out/$name.log"
    [[ $rc == 0 ]] || echo "== $name failed (rc $rc): see $out/$name.log"
}

xdist=(); [[ $cuda == 1 ]] && $py -c "import xdist" 2>/dev/null && xdist=(-n 4)  # a CPU only skips them
if [[ $cuda == 1 ]]; then  # the tuning's Triton compilations, beside the tests (both mostly CPU work)
    timeout "$(budget 300)" $py benchmarks/tune_moe_kernels.py --compile-only --jobs 12 > "$out/compile.log" 2>&1 &
    compiling=$!
fi
step correctness 300 $py -m pytest -m gpu -q -p no:cacheprovider "${xdist[@]}" --junitxml "$out/correctness.xml" \
    tests/test_gpu.py
if [[ $cuda == 1 ]]; then
    wait $compiling; echo "== compile (parallel, untimed): rc $?"; tail -n 2 "$out/compile.log"
    step tune 150 $py benchmarks/tune_moe_kernels.py --write
    cp ops/tuned_blocks.json "$out/" 2>/dev/null
    step kernels 150 $py benchmarks/moe_kernels.py --tokens 8192,16384 --profile
    step routing 90 $py benchmarks/moe_routing.py --tokens 8192 --repeats 5 --dtypes bfloat16
fi
if [[ $dry == 1 ]]; then
    step e2e 900 $py benchmarks/gpu/train_e2e.py --dry-run --profile
    mv "$out/train_e2e_dry_run.json" "$out/train_e2e.json" 2>/dev/null
else
    # shellcheck disable=SC2086
    step e2e 600 $py benchmarks/gpu/train_e2e.py ${E2E_ARGS:---layers 8 --steps 14 --warmup 4 --repeats 2 --profile}
fi
$py benchmarks/gpu/summary.py "$out"
