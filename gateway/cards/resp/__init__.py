"""Cards on Redis-protocol servers: one server (``card``) over a pooled connection (``conn``), or
a whole Redis Cluster (``cluster``: its slot map, ``cluster_map``, and where each command goes,
``cluster_route``). Imports the ``cards`` format."""
