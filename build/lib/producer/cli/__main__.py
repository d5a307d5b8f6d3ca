"""``python -m producer.cli``: the ``fleet`` command."""

from producer.cli import app

app()
