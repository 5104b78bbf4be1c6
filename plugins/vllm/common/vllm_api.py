"""The vLLM releases this package runs on, and the one guard in front of vLLM APIs that
older releases lack.

One code base serves vLLM 0.32 and 0.33 (tested: docs/vllm.md "Versions"). What 0.33 added
to the contracts (sleep mode, the offloading manager's ``lock``, config info metrics, the
``expedited`` flag of a load) is implemented as plain methods and parameters that 0.32
never calls, so no module branches on the vLLM version. The one place that must know is
an import of an API a release may lack: ``required_vllm_api`` turns the bare
``ImportError`` into one that says which adpkv class needs what and what to use instead.
The one private vLLM attribute adpkv reads is behind ``tiering_rows_file``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Optional


@contextlib.contextmanager
def required_vllm_api(user: str, needs: str, instead: str) -> Iterator[None]:
    """Imports inside the block are the vLLM API ``user`` (e.g. ``adpkv_vllm.AdpSecondaryTier``)
    cannot work without; a missing one raises ``ImportError`` naming ``needs`` (what that
    API is) and ``instead`` (what the user can run on this vLLM)."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"{user} needs {needs}; this vLLM lacks it ({exc}). {instead}") from exc


def transfer_results_type() -> Any:
    """vLLM's ``KVConnectorTransferResults`` (what ``get_transfer_results`` returns; 0.32 and
    0.33 have it, 0.26 to 0.29 do not), or None on a release without it: such a release never
    calls ``get_transfer_results`` and takes a connector's finished loads from ``get_finished``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:
        return None
    return KVConnectorTransferResults


def tiering_rows_file(spec: Any) -> Optional[str]:
    """A path that opens the shared file of the CPU tier's rows of vLLM's
    ``TieringOffloadingSpec`` (the rows start at its offset 0), or None when this vLLM does
    not show one.

    PRIVATE vLLM API: ``TieringOffloadingSpec._scheduler_mmap`` (vllm/v1/kv_offload/tiering,
    vLLM 0.32 and 0.33), an object with ``mmap_path``, ``fd`` and ``mmap_obj``; vLLM has no
    public accessor for it. A release without it gives None, and the secondary tier moves
    rows through the ring instead (slower, never wrong). The file may be unlinked already:
    then ``/proc/self/fd/<fd>`` reopens the very same file."""
    region = getattr(spec, "_scheduler_mmap", None)
    path = getattr(region, "mmap_path", None)
    fd = getattr(region, "fd", None)
    if region is None or fd is None or getattr(region, "mmap_obj", None) is None:
        return None
    return path if path and _same_file(path, fd) else f"/proc/self/fd/{fd}"


def _same_file(path: str, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
