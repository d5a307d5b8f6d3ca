"""The Celery side of a worker: everything that knows Celery and kombu.

app.py          the Celery app ``celery -A workers.consumer.app worker`` runs; signals
channel.py      the kombu Redis channel that fills the prefetch window per round trip, with
                its atomic take script (``take_many.lua``)
engine.py       the batching engine: Celery's task strategy hands it each received message;
                it wires the parts in ``workers.batching`` to this worker
lease.py        leases on held messages, inside kombu's own structures; a batch's acks and
                give-backs in one round trip
sentinel.py     the same channel behind Redis Sentinel
realtime.py     the REALTIME lane's own consumer
clock_watch.py  kombu's clock set to Redis', and the worker's skew
stats.py        the engine's fleet_stats snapshot and scrape-time gauges
"""
