"""adpkv as SGLang's HiCache L3 storage backend.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"adpkv","module_path":"adpkv_sglang","class_name":"AdpHiCacheStorage","interface_v1":1,"port":5557}'

See docs/sglang.md.
"""

from .backend import AdpHiCacheStorage

__all__ = ["AdpHiCacheStorage"]
