"""``fleet chaos``: faults injected into a real stack under load, every request's end counted.

``scenarios`` reads ``configs/chaos.toml``; ``load`` drives steady mixed traffic;
``faults`` does the harm; ``observe`` watches results and worker logs; ``tally`` turns what
was seen into the report rows; ``runner`` runs it all and writes ``reports/chaos.json``.
"""
