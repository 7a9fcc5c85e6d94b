"""The engine, which imports no Textual: ``models`` loads them, ``caches`` makes and
checks cache kinds, ``conversation`` holds a Session and its ledger, ``generation``
runs every session's forward passes in one batched loop, ``sharding`` spreads a
model over ranks, and ``cpu`` is the CPU backend's fast path."""
