"""The wire between a client and its gateway: the messages on the control port (``protocol``)
and the door, the Unix socket descriptors and proofs pass through (``door``: where it is, who may
serve it). Imports ``adpkv_core.keys`` and ``adpkv_core.memory``, nothing of the client."""
