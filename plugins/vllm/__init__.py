"""adpkv for vLLM: the KV connector ``AdpKVConnector``, the OffloadingSpec
backend ``AdpOffloadingSpec`` and ``AdpSecondaryTier``, a secondary tier of
vLLM's ``TieringOffloadingSpec`` (behind vLLM's own CPU tier).

vLLM loads them by name from this module::

    --kv-transfer-config '{"kv_connector":"AdpKVConnector","kv_connector_module_path":"adpkv_vllm",...}'
    --kv-transfer-config '{"kv_connector":"OffloadingConnector",...,"kv_connector_extra_config":
                           {"spec_name":"AdpOffloadingSpec","spec_module_path":"adpkv_vllm",...}}'
    --kv-transfer-config '{"kv_connector":"OffloadingConnector",...,"kv_connector_extra_config":
                           {"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":N,"secondary_tiers":
                            [{"type":"AdpSecondaryTier","module_path":"adpkv_vllm","port":5557}]}}'

The classes import vLLM lazily, so ``import adpkv_vllm`` works without vLLM.
Each integration is a subpackage (``connector``, ``offloading``, ``tier``) over the
part they share (``common``).
"""

__all__ = ["AdpKVConnector", "AdpOffloadingSpec", "AdpSecondaryTier"]


def __getattr__(name):
    if name == "AdpKVConnector":
        from .connector.connector import AdpKVConnector
        return AdpKVConnector
    if name == "AdpOffloadingSpec":
        from .offloading.spec import AdpOffloadingSpec
        return AdpOffloadingSpec
    if name == "AdpSecondaryTier":
        from .tier.tier import AdpSecondaryTier
        return AdpSecondaryTier
    raise AttributeError(name)
