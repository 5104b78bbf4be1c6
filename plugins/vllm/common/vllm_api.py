"""The vLLM releases this package runs on, and the one guard in front of vLLM APIs that
older releases lack.

One code base serves vLLM 0.26 and 0.28 to 0.34 (tested: docs/vllm.md "vLLM versions"). What
0.33 added to the contracts (sleep mode, the offloading manager's ``lock``, config info metrics,
the ``expedited`` flag of a load) and what 0.34 added (``kv_cache_access``,
``supports_lookahead_block_hashes``, ``may_load_async``) is implemented as plain methods and
parameters that older releases never call, so no module branches on the vLLM version. The
places that must know
ask here, by capability, never by version number: an import of an API a release may lack
(``required_vllm_api`` turns the bare ``ImportError`` into one that says which adpkv class
needs what and what to use instead), ``transfer_results_type`` (0.26 to 0.29 have no
``get_transfer_results``), ``reports_failed_requests`` (what the connector can serve
without it), ``offloading_kv_cache_layout`` (0.26's and 0.28's offloading config does not state
it), ``tiering_api_missing`` and the bridges of what vLLM 0.28 to 0.31 spell otherwise in the
tiering ``AdpSecondaryTier`` plugs into (``secondary_tier_init_args``, ``tier_row_bytes``,
``tier_job_rows``, ``job_result``), ``kv_cache_access_in_process`` (0.34's ``KVCacheAccess``) and
``offload_device_blocks`` (0.34 hands an offloading worker device pointers, not block ids).
The one private vLLM attribute adpkv reads is behind ``tiering_rows_file``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional


@contextlib.contextmanager
def required_vllm_api(user: str, needs: str, instead: str) -> Iterator[None]:
    """Imports inside the block are the vLLM API ``user`` (e.g. ``adpkv_vllm.AdpSecondaryTier``)
    cannot work without; a missing one raises ``ImportError`` naming ``needs`` (what that
    API is), the vLLM release that lacks it and ``instead`` (what the user can run there)."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"{user} needs {needs}; this vLLM ({_release()}) lacks it ({exc}). "
                          f"{instead}") from exc


def _release() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "not installed"
    return str(__version__)


def transfer_results_type() -> Any:
    """vLLM's ``KVConnectorTransferResults`` (what ``get_transfer_results`` returns; 0.30 and
    later have it, 0.26 to 0.29 do not), or None on a release without it: such a release never
    calls ``get_transfer_results`` and takes a connector's finished loads from ``get_finished``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:
        return None
    return KVConnectorTransferResults


def kv_cache_access_in_process() -> Any:
    """vLLM's ``KVCacheAccess.IN_PROCESS`` (vLLM >= 0.34, ``vllm.config.kv_transfer``), what
    ``AdpKVConnector.kv_cache_access`` answers; None on a release without it (one that never asks)."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    return KVCacheAccess.IN_PROCESS


def reports_failed_requests() -> bool:
    """Whether this vLLM takes a failed load of a whole request (``failed_recving`` of
    ``get_transfer_results``, vLLM 0.30 and later).

    Without it (vLLM 0.26 to 0.29) the only report of a failed load is by block
    (``get_block_ids_with_load_errors``, for the asynchronous loads of ``get_finished`` too), and
    vLLM 0.26's scheduler takes that only for a model with one KV cache group: with several
    (``Scheduler._update_requests_with_invalid_blocks`` unpacks one group's block ids) it raises
    and the engine dies; for a recurrent state it would restart the request from a block that
    holds no state. There the connector serves models of one attention group only
    (``ConnectorConfig.resolve``)."""
    return transfer_results_type() is not None


def offloading_kv_cache_layout(config: Any) -> str:
    """The KV cache layout of the pages ``AdpOffloadingSpec`` stores, for its model identity:
    ``OffloadingConfig.kv_cache_layout`` (vLLM 0.29 and later; unset: the attention backend's
    default, asked in neither process, so the manager and the workers agree). A vLLM whose
    config has no such field (0.26, 0.28) gets a name of its own: its objects never share a
    namespace with those of an engine that states its layout (a miss, never a wrong hit),
    and engines of that release still share theirs."""
    if not hasattr(config, "kv_cache_layout"):
        return "not-stated"
    return str(config.kv_cache_layout or "backend-default")


def tiering_api_missing() -> Optional[str]:
    """What ``AdpSecondaryTier`` needs of vLLM's tiering (vllm.v1.kv_offload.tiering) and this vLLM
    lacks, or None when it has it all: ``SecondaryTierManager``, ``TransferJob`` naming the
    CPU tier's rows (``chunk_ids``, or ``block_ids`` before vLLM 0.30), ``JobResult``. What the
    releases spell differently is bridged by the functions below; a release whose
    tiering lacks one of these gets the tier refused at import (``tier.py``), not a failure
    inside vLLM's step. The import errors of a release without a tiering package in this
    shape (0.26's: ``JobMetadata``, no ``Medium``) are the import guard's (``required_vllm_api``)."""
    try:
        from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
    except ImportError as exc:
        return f"vllm.v1.kv_offload.tiering.base ({exc})"
    fields = getattr(TransferJob, "__dataclass_fields__", {})
    missing = [] if ("chunk_ids" in fields or "block_ids" in fields) else ["TransferJob.chunk_ids"]
    if "job_id" not in getattr(JobResult, "__dataclass_fields__", {}):
        missing.append("JobResult.job_id")
    if not hasattr(SecondaryTierManager, "get_finished_jobs"):
        missing.append("SecondaryTierManager.get_finished_jobs")
    return ", ".join(missing) or None


def secondary_tier_init_args(base: Any, backpressure_detector: Any) -> tuple:
    """The arguments after ``tier_type`` that this vLLM's ``SecondaryTierManager.__init__`` takes:
    the back-pressure detector (vLLM 0.32 and later), or none (0.28 to 0.31, which have no
    back-pressure and pass none)."""
    import inspect
    takes = "backpressure_detector" in inspect.signature(base.__init__).parameters
    return (backpressure_detector,) if takes else ()


def tier_row_bytes(tier: Any, primary_kv_view: memoryview) -> int:
    """The bytes of one CPU-tier row: ``SecondaryTierManager.block_size_bytes`` (vLLM 0.32 and
    later), else what that property is there, the primary view's first stride (0.28 to 0.31)."""
    size = getattr(tier, "block_size_bytes", None)
    if size is None:
        strides = primary_kv_view.strides
        assert strides is not None, "a CPU tier's rows are a strided view"
        size = strides[0]
    return int(size)


def tier_job_rows(job: Any) -> Any:
    """The CPU tier's rows of a tiering ``TransferJob``: ``chunk_ids`` (vLLM 0.30 and later) or
    ``block_ids`` (0.28, 0.29: the same rows under their earlier name)."""
    rows = getattr(job, "chunk_ids", None)
    return job.block_ids if rows is None else rows


def job_result(result_type: Any, transfer_bytes: int, **fields: Any) -> Any:
    """A tiering ``JobResult``; ``transfer_bytes`` (the bytes moved, vLLM 0.32 and later) only
    where this vLLM's result carries it."""
    if "transfer_bytes" in getattr(result_type, "__dataclass_fields__", {}):
        fields["transfer_bytes"] = transfer_bytes
    return result_type(**fields)


def offload_device_blocks(spec: Any, tensors: Sequence[Any],
                          group_data_refs: Sequence[Sequence[Any]]) -> list[tuple[int, list[int], int]]:
    """The device side of an offloading job, per KV cache group: ``(group, block ids, logical
    index of the first block)``.

    vLLM 0.26 to 0.33 hand ``OffloadingWorker.submit_store``/``submit_load`` a
    ``GPULoadStoreSpec`` (``block_ids``, ``group_sizes``, ``block_indices``); vLLM 0.34 hands
    ``DevicePointers`` instead (``ptrs``: the address of every block's page in every tensor of
    its group, group by group, tensor by tensor, ``vllm.v1.kv_offload.pointer_utils``). Our
    copies go by block id (``copy.PagedLayer``), so a pointer is turned back into the block it
    addresses: ``(ptr - tensor.data_ptr()) / row bytes`` of the group's first tensor
    (``tensors``/``group_data_refs``: the ``CanonicalKVCaches`` the worker was built on). Every
    other tensor of the group must address the same blocks, and every pointer a whole row of its
    tensor: anything else raises ``ValueError`` (the job fails; never a copy of other blocks)."""
    ptrs = getattr(spec, "ptrs", None)
    if ptrs is None:                       # GPULoadStoreSpec (vLLM <= 0.33)
        block_ids = [int(b) for b in spec.block_ids]
        sizes = list(spec.group_sizes) if spec.group_sizes else [len(block_ids)]
        out, at = [], 0
        for g, size in enumerate(sizes):
            out.append((g, block_ids[at:at + size], int(spec.block_indices[g]) if spec.block_indices else 0))
            at += size
        return out
    import numpy as np
    ptrs = np.asarray(ptrs, dtype=np.uint64)
    out, at = [], 0
    for g, (count, n_refs, index) in enumerate(zip(spec.group_block_counts, spec.group_data_ref_counts,
                                                   spec.block_indices)):
        count, n_refs = int(count), int(n_refs)
        ids: Optional[np.ndarray] = None
        for r in range(n_refs if count else 0):
            t = tensors[group_data_refs[g][r].tensor_idx].tensor
            row = np.uint64(t.stride(0) * t.element_size())
            rel = ptrs[at + r * count: at + (r + 1) * count] - np.uint64(t.data_ptr())
            blocks = rel // row
            if bool((rel % row).any()) or bool((blocks >= np.uint64(t.shape[0])).any()):
                raise ValueError(f"adpkv: device pointers of group {g} are not rows of its tensor "
                                 f"{group_data_refs[g][r].tensor_idx}")
            if ids is None:
                ids = blocks
            elif not np.array_equal(ids, blocks):
                raise ValueError(f"adpkv: the tensors of group {g} address different blocks")
        out.append((g, [] if ids is None else ids.astype(np.int64).tolist(), int(index)))
        at += count * n_refs
    if at != len(ptrs):
        raise ValueError(f"adpkv: {len(ptrs)} device pointers for {at} block rows")
    return out


def tiering_rows_file(spec: Any) -> Optional[str]:
    """A path that opens the shared file of the CPU tier's rows of vLLM's
    ``TieringOffloadingSpec`` (the rows start at its offset 0), or None when this vLLM does
    not show one.

    PRIVATE vLLM API: ``TieringOffloadingSpec._scheduler_mmap`` (vllm/v1/kv_offload/tiering,
    vLLM 0.28 to 0.33), an object with ``mmap_path``, ``fd`` and ``mmap_obj``; vLLM has no
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
