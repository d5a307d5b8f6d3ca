"""The producer side of the fleet: the Python client, the ``fleet`` command line, the local
stack, the HTTP gateway and the harnesses (bench, chaos, soak, demo). Never imports torch.

Structure (one concern per module)::

    client.py                  FleetClient: build, validate and submit requests
      client_publish.py        task messages, queue depth, backpressure, live workers
      client_push.py           a submission's chunks and queue-length check on one connection
      client_results.py        ResultHandle, poll, wait_all, cancel; outcomes from Celery meta
      client_inputs.py         image, video and xmodal inputs; tensor wire objects -> arrays
    wire.py                    the exact bytes of a request on Redis (other languages)
    stack.py                   the local stack: up, down, workers, Flower, gateway, exporter
      stack_procs.py           spawn, wait for and stop its processes (pidfiles, logs)
      stack_redis.py           its Redis (one node)
      stack_ha.py              its Redis Sentinel set (``fleet up --ha``)
      stack_state.py           stack.json: the addresses it was started with
      stack_ports.py           replicas, ports, stacks of their own on free ports
    cli/                       ``fleet``: workers, the stack, submit, results, diagnose
    gateway/                   OIP v2 REST over the fleet (its package docstring maps it)
    exporter.py, exporter_events.py  ``fleet exporter``: queue-level Prometheus series
    flower_app.py              the Celery app Flower loads
    bench/, chaos/, soak.py    ``make bench``, ``fleet chaos``, ``fleet soak``
    demo.py, demo_gateway.py   ``make demo``
    gpucheck/                  ``make gpu-check``

Import the client's and the stack's names from ``producer.client`` and ``producer.stack``.
"""
