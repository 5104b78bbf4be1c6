"""``adpkv.shard_reads``: how a load's chunks are split into parallel GETs (pure logic; the
engine tests in test_offloading.py run loads through it with the default ``auto``)."""

import pytest

from adpkv_vllm.offloading.worker import shard_ranges
from adpkv_vllm.offloading.backend import parse_shard_reads


def test_auto_and_explicit_shards_cover_every_chunk_once():
    for count in (1, 5, 31, 32, 33, 100, 1000):
        for shards in (0, 1, 3, 8, 2000):
            ranges = shard_ranges(count, shards)
            covered = [i for a, b in ranges for i in range(a, b)]
            assert covered == list(range(count)), (count, shards)
    assert len(shard_ranges(16, 0)) == 1            # a short load stays one request
    assert len(shard_ranges(100, 0)) == 4           # one per 32 chunks
    assert len(shard_ranges(10_000, 0)) == 8        # at most 8
    assert shard_ranges(0, 0) == []


def test_setting_values():
    assert parse_shard_reads("auto") == 0 and parse_shard_reads(None) == 0
    assert parse_shard_reads("4") == 4
    with pytest.raises(ValueError):
        parse_shard_reads(0)
