#!/usr/bin/env bash
# The GPU checks and benchmarks in one go (a few minutes on one H200):
#   1. tests/test_cuda.py (head-sparse strategies vs dense-masked in fp32 and bf16, no host
#      sync in the packed path or a sampling forward, GPU vs CPU outputs, bf16 training steps);
#   2. scripts/benchmark_attention.py at batch 8 (the issue's table) and batch 32;
#   3. scripts/benchmark_model.py: DiT-XL/2 forward (bf16) and training step (bf16 autocast)
#      against diffusers' DiT;
#   4. a short scripts/train.py run on the demo shapes (accelerate, bf16), for steps/s.
#
#   bash scripts/gpu_report.sh OUT_DIR
#
# Needs torch with CUDA and diffusers importable. Without an installed moh-dit, it puts the
# source tree on PYTHONPATH (linking pipelines/ and assets/ where the package installs them).
# Everything printed also goes to OUT_DIR/gpu_report.log, and each benchmark writes its JSON
# next to it. Steps run one after another; a failing step is reported and the next one runs.
set -u
out=${1:?usage: bash scripts/gpu_report.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Is moh-dit installed? Ask from / so that this source tree does not answer for it.
if ! (cd / && python3 -c "import moh_dit") 2>/dev/null; then
    links=()
    for name in pipelines assets; do
        if [ ! -e "moh_dit/$name" ]; then
            ln -s "../$name" "moh_dit/$name" && links+=("moh_dit/$name")
        fi
    done
    trap 'rm -f "${links[@]}"' EXIT  # leave the tree as it was
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
log="$out/gpu_report.log"
: > "$log"

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

step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step attention_b8 150 python3 scripts/benchmark_attention.py --json "$out/attention_b8.json" --markdown
step attention_b32 90 python3 scripts/benchmark_attention.py --batch-size 32 --tokens 1024 --no-model \
    --json "$out/attention_b32.json" --markdown
step model_forward 120 python3 scripts/benchmark_model.py --size XL --batch-size 32 --dtype bfloat16 --repeats 15 \
    --json "$out/model_xl_forward.json"
step model_train 120 python3 scripts/benchmark_model.py --size XL --batch-size 32 --train --autocast bf16 --repeats 7 \
    --json "$out/model_xl_train.json"
work=$(mktemp -d)
step demo_data 30 python3 scripts/make_demo_dataset.py --output-dir "$work/data" --images-per-class 64
step train 90 python3 scripts/train.py --preset MoH-DiT-Tiny --data-dir "$work/data" --vae none --image-size 32 \
    --output-dir "$work/run" --max-steps 300 --global-batch-size 256 --learning-rate 1e-3 --mixed-precision bf16 \
    --log-every 100 --checkpoint-every 300
rm -rf "$work"
