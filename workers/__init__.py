"""The worker side of the fleet: a Celery worker whose messages go to a batching engine.

Folders, each importing only those below it::

    consumer/   everything that knows Celery and kombu: the app, the engine behind Celery's
                task strategy, the channel that fills the prefetch window, leases and acks
    batching/   one module per stage: admission, the batcher and its lanes, execution,
                completion and its result writes: Celery-free, so its decisions are
                unit-tested with fake models
    models/     one adapter per model kind, the device runtime, trace-cache preparation

and beside them ``janitor.py`` (the /dev/shm janitor every worker runs) and ``probe.py`` (the
transport probe task). ``tests/unit/test_import_graph.py`` holds this order.
"""
