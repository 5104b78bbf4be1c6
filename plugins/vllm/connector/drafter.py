"""EAGLE / MTP drafters' KV: which layers are the drafter's, how their objects are
named, and which of their chunks a step may save (issue 15).

A drafter (``speculative_config`` method ``eagle``, ``eagle3`` or ``mtp``) reads the
target's hidden state at position p together with the token at p + 1, so its KV at
the last position of a chunk depends on the first token of the next chunk, which
the chunk's own key (the hash of its last block) does not cover. Its objects are
therefore named by the next token's hash block instead:

- **Key**: the drafter object of chunk c is named by the hash block that holds token
  (c+1)·C, the first of chunk c+1 (vLLM's hashes are chained, so it covers chunk c
  and the next token). Two prompts that share chunk c but not the next token never
  share it. A chunk has a drafter key only once that hash block is full, so a
  restorable hit is at most the prompt's full hash blocks less one (vLLM's own
  prefix cache drops the last block of a hit for the same reason).
- **Hit**: target and drafter layers restore the same hit h, the shorter of the two
  (``clip_hit``); the load writes the drafter pages of chunks 0..h-1 from the objects
  named by hash blocks 1·C..h·C.
- **Save**: vLLM 0.32 runs the drafter after the target's forward pass and calls the
  connector's ``wait_for_save`` only after it (``gpu_model_runner.py``,
  ``defer_kv_connector_finalize`` / ``finalize_kv_connector``); the drafter's attention
  layers call ``save_kv_layer`` themselves. A drafter chunk is saved from its layer's
  own hook in the step whose drafter pass computes the chunk's last position (so never
  before the drafter computed it, and not at all when the drafter skips a step), and
  only if its key exists then, i.e. the next token is a known (prompt or already
  generated, never speculative) one in a full hash block. A chunk whose key does not
  exist yet in that step is not stored (a later hit stops before it).

Multi-module MTP (each module reads one more token ahead), ``dflash`` and ``dspark``
(non-causal multi-token drafters) keep the external cache off for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from adpkv_core.keys import chunk_digest

SUPPORTED_METHODS = ("eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class DrafterSpec:
    """The drafter's attention layers and what identifies it (part of the layout)."""

    method: str
    layers: frozenset[str]
    identity: str

    def describe(self) -> str:
        return f"{self.method} drafter x{len(self.layers)}"


def resolve_drafter(vllm_config, layer_names: Sequence[str]) -> tuple[Optional[DrafterSpec], str]:
    """(the drafter, "") for an engine with an EAGLE/MTP drafter; (None, "") without one;
    (None, why) when its KV cannot be restored correctly (the cache stays off)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.use_eagle():
        return None, ""
    off = f"speculative decoding with a {spec.method!r} drafter: "
    if spec.method not in SUPPORTED_METHODS:
        return None, off + ("a non-causal multi-token drafter's KV is not restored "
                            f"(supported: {', '.join(SUPPORTED_METHODS)})")
    if spec.use_multi_module_mtp():
        return None, off + ("multi-module MTP (each module reads one more token ahead) "
                            "is not restored")
    # the drafter's attention layers register after every target layer and are numbered
    # on from them (DeepSeek MTP: model.layers.<n>; EAGLE Llama: start_layer_id = n)
    n = vllm_config.model_config.get_total_num_hidden_layers()
    layers = frozenset(name for name in layer_names if _layer_number(name) >= n)
    if not layers or len(layers) == len(layer_names):
        return None, off + f"cannot tell its attention layers from the target's ({n} target layers)"
    draft = getattr(spec, "draft_model_config", None)
    identity = f"{spec.method}:{getattr(draft, 'model', '')}:{getattr(draft, 'revision', '')}"
    return DrafterSpec(spec.method, layers, identity), ""


def drafter_of(vllm_config, groups) -> tuple[Optional[DrafterSpec], str]:
    """``resolve_drafter`` over the connector's KV cache groups (``metadata.CacheGroup``):
    the drafter's layers must sit in full-attention or MLA groups."""
    drafter, why = resolve_drafter(vllm_config, [n for g in groups for n in g.layer_names])
    if drafter is not None:
        kinds = {g.kind for g in groups if drafter.layers & set(g.layer_names)}
        if kinds - {"full", "mla"}:
            return None, (f"speculative decoding with a {drafter.method!r} drafter whose layers are in "
                          f"{sorted(kinds)} KV cache groups (only full attention or MLA is restored)")
        if any(g.recurrent for g in groups):
            # the hit must also be a boundary with a stored recurrent state; a drafter's
            # shorter hit is not checked against it
            return None, (f"speculative decoding with a {drafter.method!r} drafter in a model with "
                          "recurrent state is not restored")
    return drafter, why


def _layer_number(name: str) -> int:
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    return nums[0] if nums else -1


# =============================================================================== keys
def draft_key_count(num_hashes: int, hashes_per_chunk: int) -> int:
    """Chunks with a drafter key when the request has ``num_hashes`` full hash blocks:
    those whose next hash block is full."""
    return max(num_hashes - 1, 0) // hashes_per_chunk


def draft_digests(block_hashes: Sequence[bytes], hashes_per_chunk: int, limit_chunks: int) -> list[bytes]:
    """16-byte names of the drafter objects of a request's first chunks: chunk c's is
    the digest of hash block (c+1)·hashes_per_chunk, the one holding its next token."""
    n = min(limit_chunks, draft_key_count(len(block_hashes), hashes_per_chunk))
    return [chunk_digest(bytes(block_hashes[(c + 1) * hashes_per_chunk])) for c in range(n)]


def clip_hit(hit: int, present: list[list[bool]], first_local: int) -> int:
    """The target's hit ``hit`` (chunks), shortened to what the drafter can restore:
    ``present[i][c]`` says drafter chunk c is stored (one list per group of drafter
    layers, each only as long as the request's drafter keys). Chunks before vLLM's
    own hit (``first_local``) need not be stored."""
    for p in present:
        h = first_local
        while h < min(hit, len(p)) and p[h]:
            h += 1
        hit = min(hit, h)
    return hit if hit > first_local else 0


def save_range(saved: int, before: int, after: int, chunk_size: int, n_keys: int) -> tuple[int, int]:
    """Drafter chunks [c0, c1) to save from the drafter's hook in a step that computes
    positions [before, after) (no speculative tokens): those whose last position the
    step computes and whose key exists (``n_keys`` drafter keys). ``saved``: chunks
    already stored or passed over."""
    c0 = max(saved, before // chunk_size)
    return c0, max(c0, min(after // chunk_size, n_keys))
