"""The local stack ``fleet up`` starts: Redis (one node or a Sentinel set), a worker per
modality, Flower, the gateway and the exporter, as background processes of this host.

    local.py       start, stop and check the stack (the entry point for ``fleet up/down``)
    sentinel.py    Redis in high-availability mode: a primary, a replica, three sentinels
    redis_node.py  one Redis server: config, ACL file, start, readiness
    procs.py       a process in its own group with a log and a pidfile
    ports.py       replicas and ports; stacks of their own on free ports (tests, drills)
    state.py       ``stack.json``: the addresses the running stack was started with
"""
