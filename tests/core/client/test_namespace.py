"""adpkv_core.keys.key_namespace: the one namespace rule of every adapter.

Same identity -> same namespace (in any process, any run); any field changed ->
another; any model-identity field unknown -> a new namespace (a miss, never a
wrong hit); the deployment namespace always counts and, with nothing derived,
is taken as given.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from adpkv_core.keys import DEFAULT_NAMESPACE, MODEL_IDENTITY_FIELDS, key_namespace

IDENTITY = dict(model="m", revision="r1", kv_dtype="bf16", geometry=[32, 8, 128], tp_size=1, chunk_size=256,
                layout="NHD")


def test_same_identity_gives_the_same_namespace_in_every_process():
    ns = key_namespace("", IDENTITY, from_model=True)
    assert ns == key_namespace("", dict(reversed(list(IDENTITY.items()))), from_model=True)
    code = ("from adpkv_core.keys import key_namespace; print(key_namespace('', dict(model='m', revision='r1', "
            "kv_dtype='bf16', geometry=[32, 8, 128], tp_size=1, chunk_size=256, layout='NHD'), from_model=True))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "random"}).stdout.strip()
    assert other == ns
    # golden: the keys of the vLLM connector (key_namespace_from_model, no adpkv.namespace) and of
    # the SGLang backend stored before this function existed are found again
    assert ns == "model-34574fd05fac22d9c1bb03075f5797b4"
    sglang = dict(model="tiny-llama", revision="-", kv_dtype="float16", geometry={"layers": 2, "heads": 2},
                  tp_size=1, chunk_size=16, layout="page_first", engine="sglang", deployment="",
                  attention="mha", pp="0/1", cp="0/1", format_tag="")
    assert key_namespace("", sglang) == "model-6d8fb913bec389cb9d441f648d4bc6f2"


@pytest.mark.parametrize("field", MODEL_IDENTITY_FIELDS + ("extra",))
def test_any_field_changed_gives_another_namespace(field):
    base = key_namespace("", {**IDENTITY, "extra": "x"}, from_model=True)
    changed = {**IDENTITY, "extra": "x", field: "other"}
    assert key_namespace("", changed, from_model=True) != base
    assert key_namespace("", {**IDENTITY, "extra": "x"}) != key_namespace("", changed)   # adapter identity too


@pytest.mark.parametrize("field", MODEL_IDENTITY_FIELDS)
@pytest.mark.parametrize("unknown", [None, "", [], "absent"])
def test_any_unknown_model_field_gives_a_new_namespace(field, unknown, caplog):
    ident = dict(IDENTITY)
    if unknown == "absent":
        del ident[field]
    else:
        ident[field] = unknown
    known = key_namespace("", IDENTITY, from_model=True)
    with caplog.at_level(logging.WARNING, logger="adpkv"):
        first = key_namespace("", ident, from_model=True)
        second = key_namespace("", ident, from_model=True)
    assert first != known and second != known
    assert first != second and first.startswith("fresh-"), "without private_to: new every time"
    assert field in caplog.text
    # private to one engine: its scheduler and workers agree, nobody else shares it
    a = key_namespace("", ident, from_model=True, private_to="engine-a")
    assert a == key_namespace("", ident, from_model=True, private_to="engine-a") != known
    assert a != key_namespace("", ident, from_model=True, private_to="engine-b")
    # an identity an adapter folds in without from_model: a given field unknown is unknown too
    if unknown != "absent":
        assert key_namespace("", ident).startswith("fresh-")


def test_explicit_namespace_is_taken_as_given_and_always_counts():
    # nothing derived: the deployment namespace exactly as given (empty: the default)
    assert key_namespace("llama-3-8b-tp1") == "llama-3-8b-tp1"
    assert key_namespace("") == DEFAULT_NAMESPACE == "default"
    # an identity folded in (from_model, or an adapter's own format fields): the deployment
    # namespace is part of it, so two deployments of one model never share keys
    a = key_namespace("tenant-a", IDENTITY, from_model=True)
    assert a != key_namespace("tenant-b", IDENTITY, from_model=True)
    assert a != key_namespace("", IDENTITY, from_model=True)
    assert a == key_namespace("tenant-a", IDENTITY, from_model=True)
    assert key_namespace("tenant-a", {"layout": "page_first"}) != key_namespace("tenant-a", {"layout": "layer_first"})
    # with from_model an unknown field still gives a new namespace, explicit namespace or not
    assert key_namespace("tenant-a", {**IDENTITY, "revision": None}, from_model=True).startswith("fresh-")
