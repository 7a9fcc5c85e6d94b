"""A sharded run's sessions on disk, above the engine and the store: rank 0 loads, saves
and deletes them on every rank (``disk``), and each follower rank runs ``follower``."""
