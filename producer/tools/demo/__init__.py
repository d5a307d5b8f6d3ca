"""``make demo``: the main job on real input (``run.py``), and its gateway phase
(``gateway.py``)."""
