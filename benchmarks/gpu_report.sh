#!/usr/bin/env bash
# The GPU checks and benchmarks in one go (a few minutes on one H200):
#   1. tests/test_cuda.py (head-sparse strategies vs dense-masked in fp32 and bf16, no host
#      sync in the packed path or a sampling forward, GPU vs CPU outputs, bf16 training steps);
#   2. benchmarks/benchmark_attention.py at batch 8 (the issue's table) and batch 32;
#   3. benchmarks/benchmark_model.py: DiT-XL/2 forward (bf16) and training step (bf16 autocast)
#      against diffusers' DiT;
#   4. a short scripts/train.py run on the demo shapes (accelerate, bf16), for steps/s.
#
#   bash benchmarks/gpu_report.sh OUT_DIR
#
# Needs torch with CUDA, diffusers and an installed moh-dit (`pip install -e .` in this
# repository): every step runs against the installed package, from OUT_DIR, so it can be
# started from any folder. Everything printed also goes to OUT_DIR/gpu_report.log, and each
# benchmark writes its JSON next to it. Steps run one after another, each under a time
# limit; a failing or timed-out step is reported and the next one runs.
set -u
out=${1:?usage: bash benchmarks/gpu_report.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$out"
# Asked from OUT_DIR, so that a source tree in the current folder cannot answer for the package.
if ! python3 -c "import moh_dit, moh_dit.pipelines, moh_dit.assets" 2>/dev/null; then
    echo "error: moh-dit is not installed for $(command -v python3); run \`pip install -e $root\` first" >&2
    exit 1
fi
log="$out/gpu_report.log"
: > "$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name: $*" | tee -a "$log"
    start=$(date +%s)
    timeout "$limit" "$@" >> "$log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
} 2>&1 | tee -a "$log"

step tests 150 python3 -m pytest -q -p no:cacheprovider "$root/tests/test_cuda.py"
step attention_b8 150 python3 "$root/benchmarks/benchmark_attention.py" --json "$out/attention_b8.json" --markdown
step attention_b32 90 python3 "$root/benchmarks/benchmark_attention.py" --batch-size 32 --tokens 1024 --no-model \
    --json "$out/attention_b32.json" --markdown
step model_forward 120 python3 "$root/benchmarks/benchmark_model.py" --size XL --batch-size 32 --dtype bfloat16 \
    --repeats 15 --json "$out/model_xl_forward.json"
step model_train 120 python3 "$root/benchmarks/benchmark_model.py" --size XL --batch-size 32 --train --autocast bf16 \
    --repeats 7 --json "$out/model_xl_train.json"
step demo_data 30 python3 "$root/scripts/make_demo_dataset.py" --output-dir "$work/data" --images-per-class 64
step train 90 python3 "$root/scripts/train.py" --preset MoH-DiT-Tiny --data-dir "$work/data" --vae none --image-size 32 \
    --output-dir "$work/run" --max-steps 300 --global-batch-size 256 --learning-rate 1e-3 --mixed-precision bf16 \
    --log-every 100 --checkpoint-every 300
