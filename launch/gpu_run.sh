#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md: correctness first, then every benchmark table, on one machine.
#
# Usage: bash launch/gpu_run.sh [--dry-run] OUT_DIR [GROUP_OR_STEP ...]
#
#   Groups, in run order: quick, profile, switches, rows and fused (only when named), correctness, exchange,
#   sampling, runtime, generate (default: all but those five). quick: the GPU tests, the roofline table, the
#   attention alone, tpspec against transformers and deterministic mode's cost at the Llama 3 8B shape, in under
#   9 minutes on one GPU. profile: the roofline's one- and eight-request steps and its batch-64 sampled columns kernel by kernel,
#   and the attention's split counts. switches: the GPU tests of the sampled columns' tail kernels, then the
#   batch-64 sampled columns with them switched off and on, twice. rows: the several-row GEMV's GPU tests and
#   linears, then the steps of 8 and 32 requests with gate/up and the LM head in cuBLAS, in it, and as they run
#   (gate/up in it storing silu(gate) * up), twice. fused: rotary inside the attention kernel and gate/up's norm
#   inside its GEMV, their GPU tests, then the steps with each against the default, twice.
#   A step's name runs that step alone (`--dry-run` lists the selected ones). Steps run in the order
#   this script lists them, whatever the order of the arguments.
#   --dry-run  print each selected step's time limit and command, and whether this build's `tpspec`
#              accepts its arguments; run nothing (needs no GPU).
#
# Each step writes OUT_DIR/<step>.log (its command, then its output); a benchmark also writes its JSON and
# PNG under OUT_DIR/<step>/, `tpspec check` its table to OUT_DIR/<step>.json. OUT_DIR/summary.tsv gets one
# line per step: step, status (ok | failed | timeout | not-built), exit code, seconds. A step that fails,
# runs past its limit, or names a command or option this build lacks (not-built) is recorded, and the
# run goes on with the next step. OUT_DIR/env.txt records the machine, the versions and the commit
# (GPU_RUN_COMMIT names it where the checkout has no .git). Exit code: 0 when every step was ok, else 1.
#
# Rank processes sharing one GPU must run concurrently, so NVIDIA MPS is started first
# (tpspec.testing.MPSDaemon) unless it runs already, and quit at the end if this script started it.
#
# Environment: PYTHON (default python3); GPU_RUN_COMMIT; TPSPEC_LL_SOURCE_DIR (a copy of csrc/ll_exchange
# to check and time instead of the checkout's); FLASHINFER_WHEELS (a folder of wheels: flashinfer-python
# is installed from it, offline, before the first step); GPU_RUN_WHEELS (a folder of wheels, every one installed
# offline before the first step: dependencies a machine with no index lacks, such as llguidance, and the
# structured-output tests' jsonschema); GPU_RUN_MAX_STEP_S (caps every step's time limit,
# for a machine that runs one command only so long).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '3,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
[ $# -ge 1 ] || usage
case "$1" in -*) usage ;; esac
OUT=$1; shift
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

# ------------------------------------------------------------------------------------------------ the steps
STEP_GROUP=(); STEP_NAME=(); STEP_LIMIT=(); STEP_CMD=()
step() {  # group name limit_s command
    STEP_GROUP+=("$1"); STEP_NAME+=("$2"); STEP_LIMIT+=("$3"); STEP_CMD+=("$4")
}
ab_steps() {  # group prefix limit_s "bench step arguments" "state|--set arguments" ...: each state in turn, twice
    local group=$1 prefix=$2 limit=$3 bench=$4 run spec; shift 4
    for run in 1 2; do
        for spec in "$@"; do
            step "$group" "$prefix-${spec%%|*}-$run" "$limit" "$T bench step $bench${spec#*|} --out $o/$prefix-${spec%%|*}-$run"
        done
    done
}
o=$(printf %q "$OUT")
T="$PY -m tpspec"

# 0. Quick (one GPU, under 9 minutes, each limit below the share it may take): the GPU tests of the kernels
#    and of the graphed steps but their slow cases (every GPU-marked test takes longer than this group's share:
#    `correctness`); the roofline table at the Llama 3 8B shape, TP=1, with the torch attention backend beside
#    triton where the runtime accepts it; the same backends' attention alone at that shape's heads; tpspec
#    against Hugging Face transformers (static cache, compiled) at batch 1, 8 and 32; deterministic mode beside
#    the default at the same shape.
quick_backends=torch
for want in "$@"; do
    case "$want" in
        quick|quick-roofline-*|quick-attention-*)
            quick_backends=$("$PY" -c 'from tpspec.bench.roofline import accepted_attention_backends as accepted
print(",".join(accepted(["torch", "triton"])))' 2>/dev/null) || quick_backends=torch
            [ -n "$quick_backends" ] || quick_backends=torch
            break ;;
    esac
done
S8B="--device cuda --tp 1 --model-shape llama-3-8b"
QUICK_GPU_TESTS="tests/test_dependent_launch.py tests/test_gemv_triton.py::test_cuda_last_split_sums_equal_the_reduction_kernel tests/test_gemv_triton.py::test_cuda_graph_replay_equals_eager tests/test_key_kernels.py tests/test_deterministic_layer_kernels.py tests/test_deterministic_attention.py tests/test_runtime_gpu.py tests/test_paged_attention_triton.py"
# The switches group also runs the batch-64 graph test with the tail kernels switched off.
QUICK_DESELECT="--deselect 'tests/test_runtime_gpu.py::test_qwen_defaults_and_logprobs_at_batch_64_stay_in_the_graph[apart]'"
step quick quick-gpu-tests 200 "$PY -m pytest -m 'gpu and not slow' -v -rfE --durations=15 -p no:cacheprovider $QUICK_DESELECT $QUICK_GPU_TESTS"
step quick quick-roofline-llama-3-8b 80 "$T bench step $S8B --roofline-only --attention-backends $quick_backends --iters 10 --warmup 2 --timeout 70 --out $o/quick-roofline-llama-3-8b"
step quick quick-attention-llama-3-8b 40 "$T bench attention --device cuda --model-shape llama-3-8b --backends $quick_backends --out $o/quick-attention-llama-3-8b"
step quick quick-hf-llama-3-8b 140 "$T bench generate $S8B --baseline hf --num-prompts 1,8,32 --prompt-len 128 --max-new-tokens 64 --timeout 130 --out $o/quick-hf-llama-3-8b"
step quick quick-deterministic-llama-3-8b 60 "$T bench generate $S8B --rates none --deterministic --num-prompts 1,8,32 --prompt-len 128 --max-new-tokens 64 --timeout 50 --out $o/quick-deterministic-llama-3-8b"

# 0b. Profile (one GPU, only when named, under 9 minutes): where the roofline's one- and eight-request steps spend
#     their time, kernel by kernel (each kernel's time past those that started before it), at 1K and 4K; the
#     batch-64 decode step greedy, on Qwen2.5's defaults and with logprobs=5 (what the sampled columns add), at 1K;
#     and the Triton attention alone at the split counts around the launch rule's choice.
step profile profile-roofline-llama-3-8b 300 "$T bench step $S8B --roofline-only --attention-backends triton --roofline-columns greedy --contexts 1024,4096 --roofline-batch 1,8 --verify-batch 1,8 --profile --iters 10 --warmup 2 --timeout 280 --out $o/profile-roofline-llama-3-8b"
step profile profile-roofline-sampled-b64 120 "$T bench step $S8B --roofline-only --attention-backends triton --roofline-columns greedy,defaults,logprobs --contexts 1024 --roofline-batch 64 --verify-batch none --profile --iters 10 --warmup 2 --timeout 110 --out $o/profile-roofline-sampled-b64"
step profile profile-attention-splits 90 "$T bench attention --device cuda --model-shape llama-3-8b --backends triton --batch 1,8 --query-len 1,4 --num-splits 1,2,4,5,8,12,16 --out $o/profile-attention-splits"

# 0c. Switches (one GPU, only when named, under 9 minutes): the kernels of the sampled columns' tail, each behind
#     its switch (the penalties inside the keys kernel, the filters read in the draw kernel, the count of a
#     step's tokens), their GPU tests (bit for bit against the torch path, and the graphed steps with them on and
#     off against eager), then the batch-64 decode step's sampled columns with them off and on (off, on, off, on;
#     `--set` switches them off in the rank processes).
SWITCHES_OFF="--set tpspec.sampling.select.PENALIZED_KEYS_KERNEL=False --set tpspec.sampling.select.FILTERS_IN_DRAW_KERNEL=False --set tpspec.sampling.penalties.COUNT_KERNEL=False"
step switches switches-gpu-tests 150 "$PY -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_key_kernels.py tests/test_runtime_gpu.py::test_qwen_defaults_and_logprobs_at_batch_64_stay_in_the_graph"
ab_steps switches switches-sampled-b64 90 "$S8B --roofline-only --attention-backends triton --roofline-columns greedy,defaults,logprobs --contexts 1024,4096 --roofline-batch 64 --verify-batch none --iters 10 --warmup 2 --timeout 80" "off| $SWITCHES_OFF" "on|"

# 1. Correctness: every GPU-marked test; the determinism suite with N rank processes on the GPU(s); the LL
#    kernel bit for bit against the CPU reference.
step correctness gpu-tests 540 "$PY -m pytest -m gpu -v -rfE -p no:cacheprovider tests"
for tp in 2 4 8; do
    step correctness check-tp$tp 300 "$T check --tp $tp --device cuda --timeout 280 --json $o/check-tp$tp.json"
done
step correctness ll-kernel-check 150 "$PY launch/ll_kernel_check.py"

# 2. The exchange: one rank's fused local stage, then the exchange across 2, 4 and 8 ranks.
step exchange exchange-tp1 200 "$T bench exchange --device cuda --tp 1 --rows 1,8,32,64,128,256 --widths 16384,32768,65536 --ag-iters 2 --timeout 180 --out $o/exchange-tp1"
for tp in 2 4 8; do
    step exchange exchange-tp$tp 150 "$T bench exchange --device cuda --tp $tp --rows 1,8,64,256 --widths 16384 --ag-iters 2 --timeout 130 --out $o/exchange-tp$tp"
done

# 3. Sampling on shards: every sampling mode, sharded vs gather + sample, 128K vocabulary, 4 to 256 rows
#    (requests x (3 drafts + 1)); the JSON holds the share of rows that fell back to a gather.
for tp in 2 4 8; do
    step sampling step-sampling-tp$tp 300 "$T bench step --device cuda --tp $tp --vocab-size 131072 --batch 1,2,8,16,64 --modes greedy,sampled,top_p,defaults --timeout 280 --out $o/step-sampling-tp$tp"
done

# 4. The runtime at a real model's shape: its decode and verification steps against the roofline floor
#    (contexts 1K and 4K, batch 1/8/32/64; the attention backend the runtime picks), at TP=1, then TP=2 and 4
#    rank processes.
for tp in 1 2 4; do
    step runtime step-llama-3-8b-tp$tp 400 "$T bench step --device cuda --tp $tp --model-shape llama-3-8b --batch 1,8,32,64 --modes greedy --timeout 380 --out $o/step-llama-3-8b-tp$tp"
done

# 5. End to end: no speculation against n-gram, draft-model and EAGLE-3 speculation at forced acceptance
#    rates; deterministic mode beside the default (the n-gram step).
step generate generate-llama-3-8b-ngram 400 "$T bench generate --device cuda --tp 1 --model-shape llama-3-8b --rates 0,1.5,3 --timeout 380 --out $o/generate-llama-3-8b-ngram"
for spec in draft_model eagle3; do
    step generate generate-llama-3-8b-$spec 400 "$T bench generate --device cuda --tp 1 --model-shape llama-3-8b --spec $spec --rates 0,1.5,3 --timeout 380 --out $o/generate-llama-3-8b-$spec"
done
step generate generate-llama-3-8b-deterministic 400 "$T bench generate --device cuda --tp 1 --model-shape llama-3-8b --rates 0,1.5,3 --deterministic --timeout 380 --out $o/generate-llama-3-8b-deterministic"

# 0d. Rows (one GPU, only when named, under 9 minutes): the several-row GEMV (five rows and more: the weight tile on
#     the left of a tl.dot): its GPU tests (the float64 reference in bfloat16 only), the linears alone at 8 and 32
#     rows against cuBLAS, then the roofline's steps of 8 and 32 requests with gate/up and the LM head in cuBLAS
#     (cublas: TRITON_GEMV_ROWS=4), in the GEMV (gemv: TRITON_GATE_UP_SILU off) and as they run (default: gate/up
#     storing silu(gate) * up), twice.
step rows rows-gpu-tests 200 "$PY -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_gemv_triton.py -k 'bfloat16 or not float64_reference'"
step rows rows-gemv-llama-3-8b 40 "$T bench gemv --device cuda --model-shape llama-3-8b --batch 8,32 --out $o/rows-gemv-llama-3-8b"
ab_steps rows rows-steps 50 "$S8B --roofline-only --attention-backends triton --roofline-columns greedy --contexts 1024,4096 --roofline-batch 8,32 --verify-batch 8 --iters 10 --warmup 2 --timeout 42" \
    "cublas| --set tpspec.model.linear.TRITON_GEMV_ROWS=4" "gemv| --set tpspec.model.linear.TRITON_GATE_UP_SILU=False" "default|"

# 0e. Fused (one GPU, only when named, under 9 minutes): two fusions no default takes yet. Their GPU tests (rotary
#     and the K/V write inside the Triton attention, paged_attention_qkv, against the two kernels it replaces; the
#     several-row norm kernel storing silu(gate) * up), then the roofline's greedy steps as they run (default), with
#     rotary inside the attention (rotary: tpspec.model.attention.FUSED_ROTARY) and with gate/up's norm inside its
#     GEMV from five rows (norm: FUSED_INPUT_ROWS=32), twice.
step fused fused-gpu-tests 150 "$PY -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_paged_attention_triton.py::test_cuda_rotary_inside_equals_the_two_kernels tests/test_gemv_triton.py::test_cuda_gate_up_stores_silu_mul"
ab_steps fused fused-steps 55 "$S8B --roofline-only --attention-backends triton --roofline-columns greedy --contexts 1024,4096 --roofline-batch 1,8,32 --verify-batch 1,8 --iters 10 --warmup 2 --timeout 47" \
    "default|" "rotary| --set tpspec.model.attention.FUSED_ROTARY=True" "norm| --set tpspec.model.linear.FUSED_INPUT_ROWS=32"

# ------------------------------------------------------------------------------------------- the selection
selected=()
if [ $# -eq 0 ]; then
    for i in "${!STEP_NAME[@]}"; do
        case "${STEP_GROUP[$i]}" in quick|profile|switches|rows|fused) ;; *) selected+=("$i") ;; esac
    done
else
    for want in "$@"; do
        found=0
        for i in "${!STEP_NAME[@]}"; do
            [ "${STEP_GROUP[$i]}" = "$want" ] || [ "${STEP_NAME[$i]}" = "$want" ] && found=1
        done
        if [ $found = 0 ]; then
            echo "gpu_run.sh: no group or step named '$want' (groups: quick profile switches rows fused correctness exchange sampling runtime generate;" \
                 "steps: bash launch/gpu_run.sh --dry-run OUT)" >&2
            exit 2
        fi
    done
    for i in "${!STEP_NAME[@]}"; do
        for want in "$@"; do
            if [ "${STEP_GROUP[$i]}" = "$want" ] || [ "${STEP_NAME[$i]}" = "$want" ]; then selected+=("$i"); break; fi
        done
    done
fi

# ------------------------------------------------------------------------------------------------ dry run
if [ $dry_run = 1 ]; then
    for i in "${selected[@]}"; do
        printf '%s [%s, %s s]\n    %s\n' "${STEP_NAME[$i]}" "${STEP_GROUP[$i]}" "${STEP_LIMIT[$i]}" "${STEP_CMD[$i]}"
    done
    echo
    echo "whether this build's tpspec parses each command's arguments:"
    for i in "${selected[@]}"; do
        case "${STEP_CMD[$i]}" in "$T "*) printf '%s\t%s\n' "${STEP_NAME[$i]}" "${STEP_CMD[$i]#"$T "}" ;; esac
    done | "$PY" -c '
import contextlib, io, shlex, sys
try:
    from tpspec.cli import build_parser
except Exception as exc:  # no torch or no package here: say so, do not fail the listing
    print(f"    (not checked: {exc})")
    sys.exit(0)
for line in sys.stdin:
    name, command = line.rstrip("\n").split("\t", 1)
    argv = shlex.split(command)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser(argv).parse_args(argv)
        verdict = "accepted"
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        verdict = "NOT ACCEPTED: " + (lines[-1] if lines else "?")
    print(f"    {name}: {verdict}")
'
    exit 0
fi

# ---------------------------------------------------------------------------------------------------- run
mkdir -p "$OUT" || exit 2
summary=$OUT/summary.tsv
[ -f "$summary" ] || printf 'step\tstatus\texit_code\tseconds\n' > "$summary"

{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'): bash launch/gpu_run.sh $OUT $*"
    echo "commit: ${GPU_RUN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git here: set GPU_RUN_COMMIT)')}"
    git status --short 2>/dev/null | sed 's/^/changed: /'
    if [ -n "${TPSPEC_LL_SOURCE_DIR:-}" ]; then echo "TPSPEC_LL_SOURCE_DIR=$TPSPEC_LL_SOURCE_DIR"; fi
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not on PATH"
    fi
    if [ -n "${FLASHINFER_WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --find-links "$FLASHINFER_WHEELS" flashinfer-python 2>&1 \
            && echo "flashinfer-python installed from $FLASHINFER_WHEELS" || echo "flashinfer-python: install failed"
    fi
    if [ -n "${GPU_RUN_WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --find-links "$GPU_RUN_WHEELS" "$GPU_RUN_WHEELS"/*.whl 2>&1 \
            && echo "installed from $GPU_RUN_WHEELS: $(cd "$GPU_RUN_WHEELS" && ls -- *.whl | tr '\n' ' ')" \
            || echo "$GPU_RUN_WHEELS: install failed"
    fi
    "$PY" -c '
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "cupy", "flashinfer"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), end="")
        if name == "torch":
            print("", "cuda", module.version.cuda, "devices", module.cuda.device_count(), end="")
        print()
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__)
' 2>&1
} >> "$OUT/env.txt"

export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/tpspec-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/tpspec-mps-log}
mps=$("$PY" -c '
from tpspec.testing import MPSDaemon
daemon = MPSDaemon()
if daemon.running():
    print("running already")
else:
    note = daemon.start()
    print("started" if note is None else f"not started ({note})")
' 2>&1 | tail -1)
echo "MPS: $mps" | tee -a "$OUT/env.txt"
stop_mps() {
    if [ "$mps" = started ]; then echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; fi
}
trap stop_mps EXIT

all_ok=1
for i in "${selected[@]}"; do
    name=${STEP_NAME[$i]} limit=${STEP_LIMIT[$i]} cmd=${STEP_CMD[$i]}
    if [ -n "${GPU_RUN_MAX_STEP_S:-}" ] && [ "$GPU_RUN_MAX_STEP_S" -lt "$limit" ]; then limit=$GPU_RUN_MAX_STEP_S; fi
    log=$OUT/$name.log
    printf '$ %s\n\n' "$cmd" > "$log"
    start=$(date +%s)
    timeout -k 15 "$limit" bash -c "$cmd" >> "$log" 2>&1 < /dev/null
    rc=$?
    seconds=$(( $(date +%s) - start ))
    if [ $rc = 0 ]; then
        status=ok
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
        status=timeout
    elif [ $rc -le 2 ] && grep -qE "unrecognized arguments|invalid choice|not available in this build|must name some of" "$log"; then
        status=not-built
    else
        status=failed
    fi
    [ $status = ok ] || all_ok=0
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" >> "$summary"
    echo "== $name: $status (exit $rc, ${seconds} s)"
    if [ $status != ok ]; then tail -n 5 "$log" | sed 's/^/   | /'; fi
done
echo "summary: $summary"
[ $all_ok = 1 ]
