"""The Celery side of a worker: everything that knows Celery and kombu.

app.py          the Celery app ``celery -A workers.consumer.app worker`` runs; signals
strategy.py     the task strategy that hands each received message to the engine
channel.py      the kombu Redis channel that fills the prefetch window per round trip
take.py         its atomic take script (``take.lua``)
sentinel.py     the same channel behind Redis Sentinel
realtime.py     the REALTIME lane's own consumer
lease.py        leases on held messages, inside kombu's own structures
acks.py         a batch's acks and give-backs in one round trip
events.py       task events coalesced into fewer round trips
clock_watch.py  kombu's clock set to Redis', and the worker's skew
engine.py       the batching engine: the parts in ``workers.batching`` wired to this worker
current.py      the one engine of this process
stats.py        the engine's fleet_stats snapshot and scrape-time gauges
"""
