"""The gateway process: the control loop and its thread pool (``server``), what STATS answers
(``stats``), ``adpkv-gateway`` (``main``). The top of the gateway: imports every subsystem below it
(``adpkv_gateway.LAYERS``)."""
