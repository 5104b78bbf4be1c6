"""``AdpSecondaryTier``, a secondary tier of vLLM's ``TieringOffloadingSpec`` (``tier``),
and the KV events it reports (``events``)."""
