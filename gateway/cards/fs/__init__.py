"""The fs card: objects as files in a directory on a local disk. The card (``card``), its index of
objects, fragments and namespaces in memory (``index``, ``rows``), the scan that rebuilds it at
start (``scan``) and the snapshot that spares it (``snapshot``), the card's files and their names
(``files``), and the lock one writing gateway holds (``lock``). Imports ``observe`` and the
``cards`` format."""
