"""The door: the Unix socket an engine's ranks come in by. Who may enter and as whom
(``entry``), taking the door's path at start (``claim``), the regions a rank hands over as open
descriptors (``regions``) and which engine is attached (``engines``). Imports ``observe``,
``cards``, ``config`` and ``store``."""
