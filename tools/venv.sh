#!/usr/bin/env bash
# Create (once) and print the path of the virtual environment NAME, built from
# requirements/NAME.txt, with the first checkout that ran it installed into it (editable, no
# deps; see the end for how other checkouts share it safely: $repo/.adpkv-src on PYTHONPATH).
# Venvs live in $ADPKV_VENV_ROOT (default ~/.cache/adpkv/venvs) and are rebuilt
# only when their requirements file changes.
set -euo pipefail
name="$1"
repo="$(cd "$(dirname "$0")/.." && pwd)"
req="$repo/requirements/$name.txt"
root="${ADPKV_VENV_ROOT:-$HOME/.cache/adpkv/venvs}"
venv="$root/$name"
post="$repo/requirements/$name.post.sh"
stamp="$(cat "$req" $( [[ -f "$post" ]] && echo "$post" ) | sha256sum | cut -c1-16)"
mkdir -p "$root"
exec 9>"$root/.$name.lock"
flock 9          # one build of a venv at a time (parallel test runs share the venvs)
if [[ ! -f "$venv/.adpkv-stamp" || "$(cat "$venv/.adpkv-stamp")" != "$stamp" ]]; then
  echo "[venv] building $venv from requirements/$name.txt (once; reused afterwards)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  # torch CPU wheels lie on local disk on these machines; pip finds them there.
  PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}" "$venv/bin/python" -m pip install -q -r "$req" >&2
  if [[ -f "$post" ]]; then
    VENV="$venv" bash "$post" >&2
  fi
  # files identical to a finished sibling venv's (the same torch, triton ... wheels) become hard links
  python3 "$repo/tools/venv_links.py" "$venv" || true
  echo "$stamp" > "$venv/.adpkv-stamp"
fi
# This checkout's packages under their import names (links), for PYTHONPATH: tools/test.sh puts
# it first, so a suite imports the checkout that runs it whatever the venv's editable install
# points at (several checkouts share one venv).
src="$repo/.adpkv-src"
mkdir -p "$src"
ln -sfn ../adpkv_core "$src/adpkv_core"
ln -sfn ../gateway "$src/adpkv_gateway"
for p in vllm lmcache sglang; do ln -sfn "../plugins/$p" "$src/adpkv_$p"; done
# The editable install (console scripts, plain `$venv/bin/python` use) is made once, by the first
# checkout; another checkout never re-points it under a checkout whose tests may be running
# (it would switch the code they import). Only when that checkout is gone does the next one take it.
owner_file="$venv/.adpkv-checkout"
owner="$(cat "$owner_file" 2>/dev/null || true)"
if [[ -z "$owner" || "$owner" == "$repo" || ! -d "$owner" ]]; then
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >&2 2>/dev/null \
    || "$venv/bin/python" -m pip install -q --no-deps -e "$repo" >&2
  echo "$repo" > "$owner_file"
else
  echo "[venv] $venv's editable install stays on $owner; this checkout's code comes first through" \
       "PYTHONPATH=$src (tools/test.sh sets it)" >&2
fi
echo "$venv"
