"""The Celery app Flower loads: the fleet's broker and settings, no tasks, no torch.

Every Flower of the fleet (``fleet up``, compose.yaml, deploy/k8s) runs ``celery -A
producer.ops.flower_app flower``, which imports this module before Flower reads its options;
so the fleet's Flower defaults are set here, as Flower's own ``FLOWER_*`` variables, and an
operator's ``FLOWER_*`` variable or ``--option`` still wins.

- ``tasks_columns``: the task list shows each request's ``result`` column: the summary its
  worker's events carry (``workers.batching.completion.event_summary``: batch id, batch size,
  queued and run ms; a failure's error code first; ``done/total`` while a video runs), and
  when it started, besides Flower's defaults.
"""

import os

from shared.celery_app import make_app
from shared.settings import load_settings

TASKS_COLUMNS = "name,uuid,state,result,received,started,runtime,worker"

os.environ.setdefault("FLOWER_TASKS_COLUMNS", TASKS_COLUMNS)

app = make_app(load_settings(), name="fleet-flower", role="operator")
