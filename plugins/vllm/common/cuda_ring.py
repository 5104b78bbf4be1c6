"""The ring as pinned host memory for CUDA.

Registering the /dev/shm mapping with the CUDA runtime (``cudaHostRegister``)
makes ring ⇄ GPU copies DMA transfers at full PCIe speed that can run
asynchronously on the connector's own stream. Where registration is refused
(no CUDA, a container without the right limits), copies stay pageable and a
warning says so once.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("adpkv.vllm")

_pinned: set[int] = set()


def pin_ring(ring: torch.Tensor) -> bool:
    """Register ``ring`` (a CPU tensor over the ring mapping) as pinned memory; True if it is."""
    if not torch.cuda.is_available() or ring is None:
        return False
    ptr, size = ring.data_ptr(), ring.numel() * ring.element_size()
    if ptr in _pinned:
        return True
    rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(rc) != 0:
        torch.cuda.cudart().cudaGetLastError()   # clear it, or the next kernel launch reports it
        logger.warning("adpkv: cudaHostRegister of the ring (%d bytes) failed (error %s): ring <-> GPU "
                       "copies stay pageable and synchronous, expect a slower restore", size, int(rc))
        return False
    _pinned.add(ptr)
    logger.info("adpkv: ring registered with CUDA as pinned memory (%d bytes)", size)
    return True


def unpin_ring(ring: torch.Tensor) -> None:
    """Undo ``pin_ring``. Call it before the last reference to the ring goes away: a
    mapping unmapped while registered leaves the driver's registration behind, and a
    later mapping at the same address then fails to register ("already mapped")."""
    ptr = ring.data_ptr()
    if ptr in _pinned:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        _pinned.discard(ptr)
