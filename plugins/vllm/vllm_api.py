"""The vLLM releases this package runs on, and the one guard in front of vLLM APIs that
older releases lack.

One code base serves vLLM 0.32 and 0.33 (tested: docs/vllm.md "Versions"). What 0.33 added
to the contracts (sleep mode, the offloading manager's ``lock``, config info metrics, the
``expedited`` flag of a load) is implemented as plain methods and parameters that 0.32
never calls, so no module branches on the vLLM version. The one place that must know is
an import of an API a release may lack: ``required_vllm_api`` turns the bare
``ImportError`` into one that says which adpkv class needs what and what to use instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def required_vllm_api(user: str, needs: str, instead: str) -> Iterator[None]:
    """Imports inside the block are the vLLM API ``user`` (e.g. ``adpkv_vllm.AdpSecondaryTier``)
    cannot work without; a missing one raises ``ImportError`` naming ``needs`` (what that
    API is) and ``instead`` (what the user can run on this vLLM)."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"{user} needs {needs}; this vLLM lacks it ({exc}). {instead}") from exc
