"""The key layout: recorded on the cards themselves (``record``), settled over a card-set change
(``change``), and the mover that brings objects from the previous layout's cards (``mover``).
Imports ``observe``, ``cards``, ``config`` and ``store``."""
