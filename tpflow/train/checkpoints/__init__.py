"""A run's checkpoints, in one package: ``format`` (atomic, verified checkpoints: writing, finding, reading,
pruning), ``files`` (the files on disk: syncing, the sealing manifest, a killed writer's leftovers), ``shards`` and
``sharded`` (a sharded run's own shards and the collective steps that write and read them), ``resume`` (which
checkpoint a run continues, decided before any model is built) and ``run`` (the trainer's ``RunCheckpoints``: saving
the run's state and putting it back)."""
