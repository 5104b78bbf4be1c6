"""Settings of the SGLang backend: the extra-config keys and how keys are named.

SGLang hands the backend ``HiCacheStorageConfig.extra_config`` (the JSON of
``--hicache-storage-backend-extra-config``). Keys we read (all optional):

- the shared adapter vocabulary of ``adpkv_core.settings.ClientConfig``: ``port``,
  ``host``, ``namespace`` (alias ``key_namespace``), ``key_namespace_from_model``,
  ``affinity_chunks``, ``timeout_s``, ``connect_timeout_s``,
  ``busy_wait_s``, ``gateway_users`` (each may also be spelled ``adpkv.<name>``);
- ``model_id``: the model identity in keys (default: SGLang's model name);
- ``revision``: the model revision, part of the identity (SGLang does not know it);
- ``engine_id``: the id every rank of this server attaches under (default
  ``sglang-<parent pid>``: the scheduler processes of one server share their parent);
- ``reconnect_s``: seconds before the first attempt to re-attach after the gateway went
  away, doubling after each failed attempt up to 60 s (0: never; default 5; the policy of
  every adapter, ``adpkv_core.attachment``);
- ``skip_existing``: ``batch_set_v1`` asks which pages are stored already and copies only
  the others (default true; one EXIST round trip per batch);
- ``prefix_keys``: SGLang passes prefix keys (its ``hicache_storage_pass_prefix_keys``, which it
  takes out of the extra config before the backend sees it). SGLang's hybrid controller drops an
  empty prefix in its hit query; with this set, such a query counts as starting at the root, so
  it finds pages stored with dialog marks from the first query on (without it, from the first
  call that brought prefix keys on). Default false.

SGLang's own keys (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``, ``allocator``, ...) are left alone. A key spelt ``adpkv.<name>`` with a name
not listed above is refused, and so is a key without the prefix that is a near miss of one of
ours (``prot``, ``namesapce``): both with "did you mean" (a typo must never run the server on
the wrong gateway or in the wrong namespace).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from typing import Any, Mapping, Optional

from adpkv_core.attachment import reconnect_setting
from adpkv_core.keys import key_namespace as core_key_namespace
from adpkv_core.settings import ClientConfig, parse_bool, refuse_unknown

logger = logging.getLogger("adpkv.sglang")

# this backend's own extra-config keys besides the shared ones (ClientConfig.setting_names)
OWN_KEYS = ("model_id", "revision", "engine_id", "skip_existing", "prefix_keys", "key_namespace")
# SGLang's own keys of the extra config, never taken for a misspelling of ours
SGLANG_KEYS = frozenset(("backend_name", "module_path", "class_name", "interface_v1", "allocator",
                         "hicache_storage_pass_prefix_keys"))


def check_keys(extra: Mapping[str, Any]) -> None:
    """Refuse an ``adpkv.*`` key that is not ours and an unprefixed near miss of ours."""
    ours = (*ClientConfig.setting_names(), *OWN_KEYS)
    what = "extra-config key of the adpkv HiCache backend"
    refuse_unknown((k for k in extra if isinstance(k, str) and k.startswith("adpkv.")),
                   ["adpkv." + n for n in ours], what)
    near = [k for k in extra if isinstance(k, str) and not k.startswith("adpkv.") and k not in ours
            and k not in SGLANG_KEYS and difflib.get_close_matches(k, ours, n=1, cutoff=0.75)]
    refuse_unknown(near, ours, what)


@dataclasses.dataclass
class SglangSettings:
    client: ClientConfig
    model_id: str
    revision: str
    engine_id: str
    reconnect_s: float
    skip_existing: bool = True
    prefix_keys: bool = False

    @classmethod
    def from_storage_config(cls, storage_config) -> "SglangSettings":
        extra: Mapping[str, Any] = dict(getattr(storage_config, "extra_config", None) or {})
        check_keys(extra)
        settings = dict(extra)
        for alias in ("key_namespace", "adpkv.key_namespace"):
            if alias in settings and "namespace" not in settings and "adpkv.namespace" not in settings:
                settings["namespace"] = settings[alias]
        client = ClientConfig.from_settings(settings, prefix="adpkv.", also=OWN_KEYS)
        model_id = _get(extra, "model_id") or getattr(storage_config, "model_name", None) or ""
        revision = str(_get(extra, "revision") or "")
        engine_id = str(_get(extra, "engine_id") or f"sglang-{os.getppid()}")
        reconnect_s = reconnect_setting(extra)
        skip = parse_bool(_get(extra, "skip_existing", True), "skip_existing")
        prefix_keys = parse_bool(_get(extra, "prefix_keys", False), "prefix_keys")
        return cls(client, str(model_id), revision, engine_id, reconnect_s, skip, prefix_keys)


def _get(extra: Mapping[str, Any], name: str, default: Any = None) -> Any:
    for k in ("adpkv." + name, name):
        if k in extra and extra[k] is not None:
            return extra[k]
    return default


def key_namespace(settings: SglangSettings, storage_config, geometry: Optional[dict],
                  format_tag: Optional[str] = None) -> str:
    """The namespace string of this deployment's keys.

    It always holds the deployment namespace, the model id and the page format
    (layout, dtype, geometry, page size, TP size for MHA, PP stage), so two
    models, or one model laid out differently, never share a key
    (``adpkv_core.keys.key_namespace``). An unknown model id gives a new
    namespace (a cold cache, never a wrong hit); with ``key_namespace_from_model``
    an unknown revision too.
    """
    geo = dict(geometry or {})
    mla = bool(getattr(storage_config, "is_mla_model", False))
    fields: dict[str, Any] = {
        "engine": "sglang",
        "deployment": settings.client.namespace,
        "attention": "mla" if mla else "mha",
        "pp": f"{getattr(storage_config, 'pp_rank', 0)}/{getattr(storage_config, 'pp_size', 1)}",
        "cp": f"{getattr(storage_config, 'attn_cp_rank', 0)}/{getattr(storage_config, 'attn_cp_size', 1)}",
        "format_tag": format_tag or "",
    }
    layout = geo.pop("layout", "")
    dtype = geo.pop("dtype", "")
    page_size = geo.pop("page_size", "")
    tp_size = "replicated" if mla else int(getattr(storage_config, "tp_size", 1))
    from_model = settings.client.key_namespace_from_model
    # without key_namespace_from_model the revision is not required: "-" stands for "not part of
    # this identity" (and keeps the keys of earlier versions); an empty model id is unknown
    revision = settings.revision if from_model else (settings.revision or "-")
    fields.update(model=settings.model_id or "", revision=revision, kv_dtype=dtype, geometry=geo,
                  tp_size=tp_size, chunk_size=page_size, layout=layout)
    return core_key_namespace(settings.client.namespace, fields, from_model=from_model)


def shard_suffix(storage_config) -> str:
    """What tells this rank's objects apart from other ranks' objects of the same page.

    MHA: every TP rank holds its own heads, so the TP rank is part of the key.
    MLA: the latent cache is the same on every TP rank; one key per page, written
    by the storage-writer rank only, read by all.
    """
    if getattr(storage_config, "is_mla_model", False):
        return ""
    return f"#tp{int(getattr(storage_config, 'tp_rank', 0))}"
