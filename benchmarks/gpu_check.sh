#!/usr/bin/env bash
# One-GPU checks of the CUDA/NCCL paths and the cost model on a real GPU, one short run:
#   1. `autopar calibrate` under torchrun (NCCL process group, GPU-sized measurements);
#   2. `autopar bench-cost` on gpt2-small and llama3-8b-2l: per-op and per-step predicted vs
#      measured, once with the device preset (--device, default h200) and once with the
#      calibrated profile.
# usage: OUT=dir DEVICE=h200 bash benchmarks/gpu_check.sh     (figures land in $OUT)
#        MODELS="gpt2-small-1l --batch 2" SEQ=128 ...         (other models, ';'-separated)
set -u
OUT=${OUT:-gpu_check_out}
DEVICE=${DEVICE:-h200}
MODELS=${MODELS:-"gpt2-small --batch 8;llama3-8b-2l --batch 4"}
SEQ=${SEQ:-1024}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

step() {  # step SECONDS COMMAND...: run with a limit, say how it ended, go on either way
    local limit=$1
    shift
    echo "== $*"
    timeout "$limit" "$@"
    echo "== rc=$?"
}

RUN="${TORCHRUN:-torchrun} --nproc_per_node 1 -m autopar"
step 150 $RUN calibrate --mesh 1 --out "$OUT/profile.json"
IFS=';' read -r -a models <<< "$MODELS"
for model in "${models[@]}"; do
    name=${model%% *}
    # shellcheck disable=SC2086
    step 200 $RUN bench-cost $model --seq "$SEQ" --mesh 1 --device "$DEVICE" --recipes auto \
        --steps 5 --json "$OUT/${name}_preset.json" --plots "$OUT/${name}_preset" --markdown
    if [ -f "$OUT/profile.json" ]; then
        # shellcheck disable=SC2086
        step 200 $RUN bench-cost $model --seq "$SEQ" --mesh 1 --profile "$OUT/profile.json" \
            --recipes auto --steps 5 --json "$OUT/${name}_calibrated.json" --no-ops --markdown \
            --plots "$OUT/${name}_calibrated"
    fi
done
