"""The storage gateway (``adpkv-gateway``): one process per host between the engines' ranks and
the cards. Its subsystems, one package each, from the bottom up; a package imports only those
below it (``LAYERS``; tests/core/test_structure.py checks every import of the tree against it):

    observe   instruments every part fills: latency histograms, progress of long work, the
              metrics registry and the status file's text
    cards     the storage backends and the object format they share (``base``: the Card
              contract; ``objfile``/``objfmt``/``checksum``: object files and checked bytes;
              ``fragments``: the one owner of the fragment-key format; ``quotas``: namespaces of
              keys and their quotas); ``cards.fs`` (a directory) and ``cards.resp`` (Redis-protocol
              servers, a Redis Cluster)
    config    the gateway's settings (``config.py``: YAML keys and flags, checked in one place)
    store     objects over cards: placement, the object store (lookups, accounted card I/O with
              the replica fallback), each card's counters and health, who owns each namespace
    door      the Unix socket engines come in by: who may enter and as whom, the door's path,
              the regions ranks hand over, which engine is attached
    layout    the key layout recorded on the cards and a card-set change (the mover)
    datapath  GET and PUT requests as jobs, batch by batch, between the cards and the ring or a
              region; MAP (direct reads)
    loop      the process: the control loop, STATS, ``main``
    ops       the tools around a gateway (CLI, doctor, bench, demo, spawn, the control client):
              never on the data path
"""

# (package, the packages it may import): each only those below it
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("observe", frozenset()),
    ("cards", frozenset({"observe"})),
    ("config", frozenset({"observe", "cards"})),
    ("store", frozenset({"observe", "cards", "config"})),
    ("door", frozenset({"observe", "cards", "config", "store"})),
    ("layout", frozenset({"observe", "cards", "config", "store"})),
    ("datapath", frozenset({"observe", "cards", "config", "store", "door"})),
    ("loop", frozenset({"observe", "cards", "config", "store", "door", "layout", "datapath"})),
    ("ops", frozenset({"observe", "cards", "config", "store", "door", "layout", "datapath", "loop"})),
)
