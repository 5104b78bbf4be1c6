"""``AdpOffloadingSpec``, a backend of vLLM's ``OffloadingConnector`` (``spec``): the
settings and key scheme both halves share (``backend``), the scheduler half (``manager``)
and the worker half (``worker``)."""
