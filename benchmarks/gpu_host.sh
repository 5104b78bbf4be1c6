#!/usr/bin/env bash
# One call on the GPU host (no network; ../shared/gpu/README.md): install the offline vLLM 0.26
# bundle if this host has not yet, put our code on the path as source, then run
# gpu_vllm_engine.py with the rest of the arguments, its output kept in OUT/run.log.
#
#   bash benchmarks/gpu_host.sh INSTALLER PARTS_DIR OUT [gpu_vllm_engine.py arguments...]
#
# INSTALLER is ../shared/gpu/install_vllm_bundle.sh (copied beside the parts: ../shared does not
# travel), PARTS_DIR the folder holding the bundle's parts.
set -euo pipefail
INSTALLER=${1:?usage: gpu_host.sh INSTALLER PARTS_DIR OUT [args...]}
PARTS=${2:?parts folder}
OUT=${3:?output folder}
shift 3
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -f /tmp/vsite/.vllm_bundle ]; then
  bash "$INSTALLER" "$PARTS" /tmp/vsite
fi
SRC=/tmp/adpkv-src
rm -rf "$SRC"; mkdir -p "$SRC"
ln -s "$REPO/adpkv_core" "$SRC/adpkv_core"
ln -s "$REPO/gateway" "$SRC/adpkv_gateway"
ln -s "$REPO/plugins/vllm" "$SRC/adpkv_vllm"
export PYTHONPATH="/tmp/vsite:$SRC${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/run.log"
set -o pipefail
python3 "$REPO/benchmarks/gpu_vllm_engine.py" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/run.log"
