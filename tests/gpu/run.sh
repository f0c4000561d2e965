#!/usr/bin/env bash
# Every GPU check on one NVIDIA GPU, in under 8 minutes:
#   1. `pytest -m gpu`: torch float16/bfloat16, onnx float32/float16 (CUDA EP), ctranslate2 float16/int8_float16
#      and tensorrt float16 against torch float32 on CPU, for embedding, reranker and classifier; the
#      padding-free torch forward (varlen FlashAttention; BERT, XLM-R, ModernBERT with its sliding window,
#      Qwen3 causal) against the padded one;
#   2. a tiny engine matrix: `python -m encoderd.workers.bench_engines --device cuda --quick` (embedding only).
#
# Needs: torch with CUDA, onnxruntime-gpu (not onnxruntime: they overwrite each other), ctranslate2, and the
# TensorRT 10 libraries for the tensorrt rows (without them those rows fail with a message saying so).
# Works without pyzmq, grpcio or grpcio-tools: the GPU tests call the backends in-process, and when the
# server stack is missing pytest runs only tests/integration/test_engines.py, without tests/conftest.py.
#
# Usage: tests/gpu/run.sh [DEVICE]   (default cuda:0). Exit status: non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE="${1:-cuda:0}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
INDEX="${DEVICE#cuda}"; INDEX="${INDEX#:}"
# Show the tests one GPU, which they address as "cuda".
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-${INDEX:-0}}"
CACHE="$(mktemp -d -t encoderd-gpu-XXXXXX)"
trap 'rm -rf "$CACHE"' EXIT
status=0

python - <<'EOF' || exit 1
import importlib.metadata as md, torch
assert torch.cuda.is_available(), "torch sees no CUDA device: nothing to check"
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "CUDA", torch.version.cuda)
for dist in ("onnxruntime-gpu", "onnxruntime", "ctranslate2", "tensorrt", "tensorrt-cu12-libs", "tensorrt-cu13-libs"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
EOF

echo "== pytest -m gpu"
if python -c "import grpc, grpc_health, zmq" 2>/dev/null; then
    timeout 300 python -m pytest -m gpu -q -rs -p no:cacheprovider tests || status=1  # engines, replicas on GPUs
else
    echo "(no grpc/pyzmq: in-process engine tests only)"
    PYTHONPATH=tests timeout 300 python -m pytest -m gpu -q -rs -p no:cacheprovider --noconftest \
        tests/integration/test_engines.py tests/integration/test_packed_forward.py || status=1
fi

echo "== engine matrix (embedding, quick)"
timeout 150 python -m encoderd.workers.bench_engines --device cuda --quick --kinds embedding \
    --cache-dir "$CACHE" || status=1

exit $status
