"""Dynamic batching, Celery-free: from a received request to its stored result.

Nothing here imports Celery or kombu (``tests/unit/test_import_graph.py``), so every decision
is unit-tested with fake models and requests. One module per stage a request goes through:

    admission.py    envelope -> held request (Work), or a coded refusal; poison accounting
                    and the gate on blame records (``blame_arrive.lua``,
                    ``inflight_begin.lua``): a message that keeps killing workers refused,
                    a suspect run alone, a request with a final result not run
    batcher.py      which held requests run together and when (pure); the inference threads
                    (lanes) that run them; warmup left for idle time
    execution.py    a batch -> outcomes: circuit breaker (a model that keeps failing is not
                    fed), the gate, preprocess, bisection, retries, latency
    completion.py   hand-off to the loop thread and what it does: first-wins result writes
                    (``results_write_first.lua``), events, acks, the log line

Beside the stages:

    refusals.py     Redis refusing writes: hold, back off, resume
    tensor_lease.py input segments' leases (requests with /dev/shm inputs)
    heap.py         short GC pauses, freed memory returned
    inject.py       injected request failures, for tests and drills
"""
