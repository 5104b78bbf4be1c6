"""Objects over cards: which card holds a key (``placement``), the object store the data path and
the control loop ask (``object_store``: lookups, accounted card I/O with the replica fallback,
writes, pins), each card's I/O counters (``card_stats``) and health checks (``health``), and who
owns each key namespace (``namespaces``). Imports ``observe``, ``cards`` and ``config``."""
