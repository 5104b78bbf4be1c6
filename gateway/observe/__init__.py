"""Instruments every part of the gateway fills (the bottom of ``adpkv_gateway.LAYERS``: imports
nothing of the gateway): latency histograms (``latency``), progress of long work on a terminal or
in logs (``progress``), the gateway's Prometheus registry (``metrics``) and the text of its status
file (``status``)."""
