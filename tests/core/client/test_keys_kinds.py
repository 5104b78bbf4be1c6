"""The one registry of cache kinds (``adpkv_core.keys``) and the bytes of keys already stored."""

from __future__ import annotations

from adpkv_core import keys as K


def test_every_kind_is_registered_once_in_keys():
    """Each adapter's kind is a name of ``adpkv_core.keys`` with its own value (SGLang's
    auxiliary pages, vLLM's tier rows)."""
    kinds = {name: getattr(K, name) for name in dir(K) if name.startswith("KIND_")}
    assert kinds == {"KIND_KV": 0, "KIND_AUX": 1, "KIND_TIER_ROW": 7}
    assert len(set(kinds.values())) == len(kinds) and set(K.KINDS) == set(kinds.values())


def test_key_bytes_are_those_already_stored():
    """The key layout stays byte for byte (objects on the cards are found by these bytes):
    version | namespace id | chunk digest | layer | kind."""
    b = K.KeyBuilder("default")
    key = b.key(b"\x11" * 16, 3, K.KIND_TIER_ROW)
    assert key == bytes([1]) + K.namespace_id("default") + b"\x11" * 16 + b"\x00\x03" + b"\x07"
    assert key.hex() == "01" + K.namespace_id("default").hex() + "11" * 16 + "0003" + "07"
    assert b.keys([b"\x22" * 16], [0, 1], kind=2) == [
        bytes([1]) + K.namespace_id("default") + b"\x22" * 16 + layer + b"\x02" for layer in (b"\x00\x00", b"\x00\x01")]
