"""The sans-I/O protocol core: events, outgoing transfers, sender, receiver, the endpoint and the
transpose all-reduce (:mod:`.collective`). Callers pass ``now`` and datagrams; no socket, loop,
thread or clock lives here."""
