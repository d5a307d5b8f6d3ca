"""The Celery app Flower loads: the fleet's broker and settings, no tasks, no torch."""

from shared.celery_app import make_app
from shared.settings import load_settings

app = make_app(load_settings(), name="fleet-flower", role="operator")
