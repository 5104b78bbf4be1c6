"""Objects over cards, the one way to them: ``object_store`` (``ObjectStore``, a thin facade: a
request batch's operations) over its parts, one role each: ``service`` (which cards are in
service), ``placement`` (which card a key lives on, now and during a card-set change), ``plan``
(an object's fragments on a card), ``lookup`` (which card holds each object whole), ``card_io``
(every card command, accounted, with the replica fallback, writes and removals), ``pins``;
beside them each card's I/O counters (``card_stats``) and health (``health``), and who owns
each key namespace (``namespaces``). Imports ``observe``, ``cards`` and ``config``."""
