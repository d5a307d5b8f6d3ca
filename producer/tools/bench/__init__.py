"""``make bench``: replay a workload against the fleet, a plain-Celery baseline and the
in-process limit, in one run. The method is in ``producer/tools/bench/README.md``.

Modules: ``workload`` (the TOML schema), ``sources`` (inputs from the repo's data),
``schedule`` (send times and mix, pure), ``generator`` (sending threads), ``collector``
(results and task events), ``records`` (per-request facts), ``stats`` (percentiles and
summaries, pure), ``runner`` (the modes), ``transport`` (the tensor-transport workload's own
runner), ``limit`` (in-process ceiling), ``report`` (JSON and tables), ``plot`` (PNG). Never
imports torch, except ``limit`` in its own process.
"""
