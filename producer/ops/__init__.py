"""What operators run beside the fleet: the queue exporter for Prometheus and Flower's app.

exporter.py         ``fleet exporter``: queue depth, demand and age at each scrape
sent_events.py  ``celery_task_sent_total`` counted from producers' task-sent events
flower_app.py       the Celery app Flower loads (no tasks, no torch)
"""
