"""Real redis-server processes for the resp card tests (see adpkv_gateway.ops.spawn.RedisServer)."""

from adpkv_gateway.ops.spawn import REDIS, RedisServer  # noqa: F401
