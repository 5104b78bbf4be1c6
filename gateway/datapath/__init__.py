"""The data path: GET and PUT requests (``data_requests``) as jobs of ring batches (``jobs``,
``ring_alloc``) that ``transfers`` runs between the cards and the ring, a client's region
(``region_io``, ``scatter``) or reader processes (``io_procs``); its messages to the ranks
(``replies``: the gateway's one sender on the control socket); MAP's read-only descriptors
(``direct_reads``); the loop's handoff to its pools (``handoff``). Imports ``observe``, ``cards``,
``config``, ``store`` and ``door``."""
