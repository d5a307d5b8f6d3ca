"""The producer side of the fleet. The client, ops, stack and gateway never import torch or
worker code; the tools and the CLI load models inside the functions that need them.

Folders, each importing only those listed after it::

    tools/     bench, chaos, demo, soak, gpucheck: harnesses that run the fleet
    cli/       ``fleet``: workers, the stack, submit, results, diagnose
    gateway/   the Open Inference Protocol over the fleet (HTTP)
    stack/     the local stack: Redis (or its Sentinel set), workers, Flower, gateway
    ops/       the queue exporter and Flower's app
    client/    FleetClient: what a backend service imports (``from producer.client import
               FleetClient``); it imports no other producer folder

``tests/unit/test_import_graph.py`` holds this order.
"""
