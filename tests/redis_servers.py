"""Real redis-server processes for the resp card tests (see adpkv_gateway.spawn.RedisServer)."""

from adpkv_gateway.spawn import REDIS, RedisServer  # noqa: F401
