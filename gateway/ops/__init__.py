"""Operations: the tools around a gateway, none of them on its data path. The ``adpkv`` CLI
(``cli``: status, usage, clean, drain, bench, doctor, demo), ``adpkv doctor``'s checks (``doctor``
over the host and the gateway, ``doctor_fs`` over fs cards, both given a ``doctor_host.Host``
and returning ``doctor_report.Finding``s), the bench (``bench``), the demo (``demo``) and a
gateway started as a child process (``spawn``: for the demo, the bench and tests)."""
