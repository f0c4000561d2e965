#!/usr/bin/env bash
# Fills the ignored .whl/ folder with what tests/gpu/device_check.sh installs on the GPU test machine,
# which has no network: the cp312 manylinux wheels of what encoderd's serving path imports and that
# machine lacks or has too old, encoderd's own wheel built from this checkout, and the bundled MiniLM's
# files without its weights (tests/gpu/minilm.py writes seeded ones there). Run it here (PyPI reachable),
# then make the one device call written in device_check.sh's header.
#
# What the machine has (/work/.library/device/KINDS.md): Python 3.12, torch 2.11, transformers 5.17,
# sentence-transformers 6.0.1, tokenizers, numpy, uvloop, prometheus-client, huggingface-hub, httpx,
# pytest + pytest-timeout, an older grpcio and protobuf; not pyzmq, msgspec, grpcio-health-checking,
# grpcio-reflection, grpcio-status, googleapis-common-protos, orjson, pytest-asyncio. The versions below are
# this project's tested ones. protobuf must be at least the protoc that generated
# protos/encoderd/v1/*_pb2.py (its header: "Protobuf Python Version"), grpcio at least the
# GRPC_GENERATED_VERSION of *_pb2_grpc.py; the grpc family is carried as one set, so pip's
# --no-deps install cannot mix ours with the machine's older grpcio.
#
# Usage: tests/gpu/fetch_wheels.sh      Exit status 1 when the carry would exceed 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
WHEELS=(
    grpcio==1.85.3
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    grpcio-status==1.85.3
    protobuf==7.36.2
    googleapis-common-protos==1.76.0
    pyzmq==27.3.0
    msgspec==0.23.0
    orjson==3.13.0
    pytest-asyncio==1.5.0
)
BUDGET=$((64 << 20))  # the device tool's limit on the working tree plus the carried paths, per call

grep -qx '/.whl/' .gitignore || { echo ".whl/ must be ignored (.gitignore: /.whl/)" >&2; exit 1; }
rm -rf .whl
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${WHEELS[@]}"

# encoderd itself, from this checkout (pure Python).
"$PYTHON" -m pip wheel -q --no-deps -w .whl .  # its build-system (setuptools>=77) from PyPI

# The bundled MiniLM's config, tokenizer and sentence-transformers files, without model.safetensors.
"$PYTHON" tests/gpu/minilm.py --export .whl/minilm >/dev/null

# One version of each package: two would stop the whole --no-deps install.
dupes="$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)"
[ -z "$dupes" ] || { echo "two versions of: $dupes" >&2; exit 1; }

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb .whl | cut -f1)
total=$((tree + carried))
ls -l .whl
echo "working tree $((tree >> 10)) KiB + .whl $((carried >> 10)) KiB = $((total >> 20)) MiB of the 64 MiB a call carries"
[ "$total" -le "$BUDGET" ] || { echo "over the 64 MiB carry budget" >&2; exit 1; }
