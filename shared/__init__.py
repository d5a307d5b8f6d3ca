"""The fleet's common code: settings, task schema, tensor transport, errors, metrics.

Structure (one concern per module)::

    settings/                  typed settings (configs/fleet.toml + FLEET_*), load_settings;
      redis.py                 [redis], and the credentials and URLs derived from it
      paths.py                 config files, the run directory, secret files
    model_kinds.py             the model kinds: each one's options and adapter
    schema.py                  the schema on Redis: every Celery name and Redis key, the task
                               envelope, priority classes and deadlines, result JSON
    errors.py                  the error hierarchy, each with a stable code
    tensor_wire.py             the tensor wire forms ("shm" / "inline"): recognised here
    celery_app.py              the Celery app factory (producers and workers)
    redis_client.py, ha.py     direct Redis clients; Sentinel transports (WAIT)
    acl.py                     the Redis ACL users of the fleet's roles
    queue_stats.py             queue depth and demand (``fleet exporter``)
    metrics/                   Prometheus series: their table, the worker's (or null) objects
    tracing.py                 OpenTelemetry tracing (off by default), both sides' spans
    procs.py                   process liveness on this host
    transport/                 /dev/shm tensor transport (its package docstring maps it)

Import settings names from ``shared.settings``.
"""

import os

# Arrow's default allocator (mimalloc) is not fork-safe: a child forked while another thread
# allocates through it waits forever on its page-map mutex (measured: a put in a child forked
# during another thread's put hung). glibc's malloc is (it has atfork handlers), and the
# transport allocates only IPC metadata through Arrow. Set before pyarrow is first imported
# (it reads the variable once); a choice the user made already wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
