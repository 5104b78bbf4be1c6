"""The KV connector ``AdpKVConnector`` (``connector``): its scheduler half (``scheduler``,
with ``drafter`` and ``recurrent``), its worker half (``worker``, with ``transfers``,
``fanout``, ``heads`` and ``kv_gate``) and the metadata between them (``metadata``)."""
