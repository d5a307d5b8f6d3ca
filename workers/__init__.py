"""The worker side of the fleet: a Celery worker whose messages go to a batching engine.

Structure (one concern per module)::

    app.py, strategy.py, realtime.py   the Celery app, the task strategy that hands each
                                       received message to the engine, the REALTIME consumer
    engine.py                          wires the parts below into lanes and a lifecycle
      engine_stats.py                  its fleet_stats snapshot and scrape-time gauges
      admission.py                     envelope -> pending request, or a coded refusal
      poison.py                        delivery counts: WORKER_LOST refusal, suspects alone
      batcher.py                       which held requests run together, and when (pure)
      lanes.py                         the inference threads and their retry delay queue
      execution.py                     a batch -> outcomes: breaker, preprocess, bisection,
                                       retry decisions, latency observations
      completion.py                    hand-off to the loop thread: events, store, acks, log
      work.py                          what the parts pass each other (Work, Done, ...)
    circuit.py                         the per-model circuit breaker (pure)
    results.py, inflight.py, acks.py   first-wins result writes, the in-flight gate, batch acks
                                       and give-backs (messages returned unrun)
    lease.py, tensor_lease.py          message leases, input leases
    broker.py, broker_take.py          the window's fetch (kombu transport), its take script
    broker_ha.py                       the same fetch behind Redis Sentinel
    runtime.py, warmup.py              the device slot, bucket warmup plans
    models/                            one adapter per model kind (``models/base.py``)
    faults.py, probe.py, telemetry.py, events.py, janitor.py  the rest

admission, poison, execution, completion, lanes and work import neither Celery nor Redis:
their decisions are unit-tested with a fake model and fake requests
(``tests/unit/test_execution.py``, ``tests/unit/test_admission_poison.py``).
"""
