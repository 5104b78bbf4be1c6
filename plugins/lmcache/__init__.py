"""adpkv as a persistent L2 tier of LMCache (lmcache 0.5.x ``plugin`` L2 adapter).

Select it with::

    lmcache server ... --l2-adapter '{"type":"plugin","module_path":"adpkv_lmcache",
        "class_name":"AdpL2Adapter","adapter_params":{"port":5557,"namespace":"llama-3-8b"}}'

LMCache finds ``AdpL2AdapterConfig`` by name and builds it from ``adapter_params``.
See docs/lmcache.md.
"""

from ._compat import LMCACHE_VERSION, check_lmcache_version
from .adapter import AdpL2Adapter
from .config import AdpL2AdapterConfig

__all__ = ["AdpL2Adapter", "AdpL2AdapterConfig", "LMCACHE_VERSION", "check_lmcache_version"]
