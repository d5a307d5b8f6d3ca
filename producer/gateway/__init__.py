"""The HTTP gateway: Open Inference Protocol v2 REST (and Triton's binary-data extension)
over the fleet, for clients that do not speak Celery. A producer: never imports torch.

Structure (one concern per module)::

    app.py            the app: error handlers, OpenAPI document, routes registered
    state.py          its state (Gateway): settings, token, models, the job service
      routes_server.py  health, server metadata, model metadata and readiness
      routes_infer.py   inference (sync, or 202 + Location)
      routes_jobs.py    a job's state, its events (SSE), cancel
      routes_docs.py    the API page (/docs): Swagger UI from a package, no CDN
    codec.py          OIP tensors, the binary extension
    models.py         served models, their inputs and outputs (metadata)
      hf_config.py      what a Hugging Face folder's config.json says: sizes, labels
      weights.py        where a model's weights come from
    params.py         priority, timeout, Prefer, ids
    jobs.py           submit, idempotency, state, cancel
    commit.py         a job's record and message: one transaction, once per id
    crashpoints.py    debug-only pauses where a crash test kills the gateway
    waiter.py         results over pubsub
    events.py         the Server-Sent Events stream of one job
    admission.py      QUEUE_FULL, DEADLINE_UNREACHABLE
    auth.py           the bearer token
    render.py         responses
    errors.py         codes -> statuses
    openapi.py        the OpenAPI models of the routes
    server.py         ``fleet gateway``: uvicorn
"""
