"""Dynamic batching, Celery-free: from a received request to its stored result.

Nothing here imports Celery or kombu (``tests/unit/test_import_graph.py``), so every decision
is unit-tested with fake models and requests.

    admission.py    envelope -> pending request, or a coded refusal
    batcher.py      which held requests run together, and when (pure)
    lanes.py        the inference threads and their retry delay queue
    execution.py    a batch -> outcomes: breaker, preprocess, bisection, retries, latency
    completion.py   hand-off to the loop thread: events, result store, acks, log
    work.py         what the parts pass each other (Work, Done, ...)
    poison.py       delivery counts: WORKER_LOST refusal, suspects run alone
    inflight.py     drop requests that already have a final result
    circuit.py      the per-model circuit breaker (pure)
    results.py      first-wins result writes (``write_first.lua``)
    refusals.py     Redis refusing writes: hold, back off, resume
    tensor_lease.py input segments' leases
    warmup.py       bucket warmup plans
    heap.py         short GC pauses, freed memory returned
    inject.py       injected request failures, for tests and drills
    telemetry.py    the engine's tracing hooks
"""
