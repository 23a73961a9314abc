#!/usr/bin/env bash
# The GPU report in one go; the step limits add up to 460 s, so it fits in 8 minutes:
#   1. tests/test_cuda.py (head-sparse strategies vs dense-masked in fp32 and bf16, no host
#      sync in the packed path, a sampling forward or a training step, GPU vs CPU outputs);
#   2. benchmarks/speed_report.py train: DiT-XL/2, MoH-DiT-XL/2-90 and -75 at the largest batch
#      that fits, bf16 autocast, eager and compiled per block: ms/step, images/s, MFU;
#   3. benchmarks/speed_report.py sample: MoH-DiT-XL/2-90, 256 px, 250 DDPM steps with guidance,
#      eager and compiled: images/s (and the hours 50K images take at that rate);
#   4. benchmarks/speed_report.py forward: MoH-DiT-XL/2-90 vs DiT-XL/2 forward at the trained
#      ratio, bf16, eager and compiled.
#
#   bash benchmarks/gpu_report.sh OUT_DIR
#
# Needs torch with CUDA, diffusers and an installed moh-dit (`pip install -e .` in this
# repository): every step runs against the installed package, from OUT_DIR, so it can be
# started from any folder. Everything printed also goes to OUT_DIR/gpu_report.log; each
# section writes OUT_DIR/speed_SECTION.json and .md as its rows are measured, and the tables
# are joined into OUT_DIR/speed_report.md at the end. Steps run one after another, each under
# a time limit; a failing or timed-out step is reported (its finished rows kept) and the next
# one runs.
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

step tests 80 python3 -m pytest -q -p no:cacheprovider "$root/tests/test_cuda.py"
for section in train sample forward; do
    case $section in train) limit=200 ;; sample) limit=120 ;; forward) limit=60 ;; esac
    step "speed_$section" "$limit" python3 "$root/benchmarks/speed_report.py" "$section" \
        --json "$out/speed_$section.json" --markdown "$out/speed_$section.md"
done
{
    echo "# Speed report"
    echo
    echo "commit $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown); every number below was measured in this run."
    for section in train sample forward; do
        echo
        if [ -f "$out/speed_$section.md" ]; then cat "$out/speed_$section.md"; else echo "## $section: no rows (see gpu_report.log)"; fi
    done
} > "$out/speed_report.md"
echo "== report: $out/speed_report.md" | tee -a "$log"
