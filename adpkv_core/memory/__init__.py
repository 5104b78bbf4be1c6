"""The memory a client shares with its gateway: the ring (``ring``), an engine's own buffers
handed over as regions (``regions``: which shared-memory file backs one) and the locks that give
a region back only once the gateway can no longer write it (``region_lock``). The bottom of
``adpkv_core``: imports nothing of it."""
