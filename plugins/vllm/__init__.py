"""adpkv for vLLM: the KV connector ``AdpKVConnector`` and the OffloadingSpec
backend ``AdpOffloadingSpec``.

vLLM loads them by name from this module::

    --kv-transfer-config '{"kv_connector":"AdpKVConnector","kv_connector_module_path":"adpkv_vllm",...}'
    --kv-transfer-config '{"kv_connector":"OffloadingConnector",...,"kv_connector_extra_config":
                           {"spec_name":"AdpOffloadingSpec","spec_module_path":"adpkv_vllm",...}}'

The classes import vLLM lazily, so ``import adpkv_vllm`` works without vLLM.
"""

__all__ = ["AdpKVConnector", "AdpOffloadingSpec"]


def __getattr__(name):
    if name == "AdpKVConnector":
        from .connector import AdpKVConnector
        return AdpKVConnector
    if name == "AdpOffloadingSpec":
        from .offloading import AdpOffloadingSpec
        return AdpOffloadingSpec
    raise AttributeError(name)
