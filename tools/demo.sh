#!/usr/bin/env bash
# The main job on a fresh machine: a gateway on the default fs card in ./adpkv-card,
# one prompt's KV stored through it, the gateway restarted, the prompt restored byte-exact.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$(bash "$repo/tools/venv.sh" core)"
exec "$venv/bin/adpkv" demo "$@"
