"""Share the identical files of a new virtual environment with its finished siblings, as hard links.

    python3 tools/venv_links.py VENV        (tools/venv.sh runs it after a build)

The engine venvs pin the same wheels (torch 2.13.0 CPU, triton, transformers ... in vllm,
vllm028 .. vllm031, lmcache): about 2.9 of each vllm0NN venv's 3.4 GB are files that a sibling
holds byte for byte under the same path. Each such file of VENV's lib/ becomes a hard link to the
sibling's (same path, size, mode and bytes, compared in full; only files of 64 KiB and more: 2.5 GB of
those bytes in about 15 s). Nothing else changes: a link swaps in atomically (os.replace), pip
replaces rather than rewrites a file it upgrades or removes, and a sibling removed or rebuilt later
leaves the inode to VENV. Siblings are the venvs beside VENV that finished their build (an
.adpkv-stamp); another file system, or any error, leaves the file as it is.
"""

from __future__ import annotations

import filecmp
import os
import sys

MIN_BYTES = 64 << 10


def _files(venv: str) -> dict[str, os.stat_result]:
    out = {}
    lib = os.path.join(venv, "lib")
    for top, _dirs, names in os.walk(lib):
        for name in names:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_size >= MIN_BYTES and os.path.isfile(path) and not os.path.islink(path):
                out[os.path.relpath(path, venv)] = st
    return out


def link_identical(venv: str) -> tuple[int, int]:
    """Returns (files linked, bytes shared)."""
    venv = os.path.abspath(venv)
    root = os.path.dirname(venv)
    siblings = sorted(os.path.join(root, d) for d in os.listdir(root)
                      if os.path.join(root, d) != venv and os.path.isfile(os.path.join(root, d, ".adpkv-stamp")))
    mine = _files(venv)
    linked = shared = 0
    for sibling in siblings:
        for rel, st in list(mine.items()):
            other = os.path.join(sibling, rel)
            try:
                ost = os.stat(other)
                if (ost.st_size, ost.st_dev, ost.st_mode) != (st.st_size, st.st_dev, st.st_mode):
                    continue
                if ost.st_ino == st.st_ino:
                    del mine[rel]
                    continue
                path = os.path.join(venv, rel)
                if not filecmp.cmp(path, other, shallow=False):
                    continue
                tmp = path + ".adpkv-link"
                os.link(other, tmp)
                os.replace(tmp, path)
            except OSError:
                continue
            del mine[rel]
            linked += 1
            shared += st.st_size
    return linked, shared


if __name__ == "__main__":
    n, b = link_identical(sys.argv[1])
    print(f"[venv] {sys.argv[1]}: {n} files ({b / 1e9:.2f} GB) hard-linked to identical files of sibling venvs",
          file=sys.stderr)
