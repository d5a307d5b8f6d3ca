"""``make gpu-check``: one short script that checks the device runtime on a CUDA machine and
benches the fleet there, within 10 minutes in all.

``python -m producer.tools.gpucheck [--out FILE.json] [--parts checks,overhead,text,image]
[--budget-s 540] [--bench-dir reports/gpucheck]``. Without CUDA, and ``--parts`` not given, it
prints ``gpu-check: skipped (no CUDA device)`` and exits 0; with ``--parts`` it runs the parts
that need no GPU (``overhead``) and reports each CUDA part as skipped. With CUDA it runs five
device checks, each in fresh processes of the ``spawn`` context (CUDA is never initialised in
this parent process), then the benches of ``benches.py`` (overhead-saturate's ``fleet`` and
``redis-limit`` modes on the identity model, text- and image-saturate on CUDA, one short
repetition each, under the time budget), prints each figure, and exits 1 if any fails:

1. stream per process: two processes at once, each with a started
   ``DeviceRuntime(device="cuda:0", memory_fraction=0.2)``, report a stream handle that is
   not the default stream, and inside ``batch_context()`` the current stream is theirs;
2. memory fraction enforced: with ``memory_fraction=0.05``, one allocation past the fraction
   raises ``torch.OutOfMemoryError``, and filling memory in 64 MiB chunks raises before the
   reserved memory passes the fraction (reports the MiB reached vs the fraction's MiB);
3. no arena growth over 1,000 batches: a small MLP, batch sizes cycling 1/8/16/32 through
   ``stage()`` (when the runtime has it) and ``batch_context()``; reserved and allocated
   device memory after the 1,000 batches are no larger than after the warmup;
4. warm vs cold first-batch latency: the first batch of a fresh process without warmup
   (cold) vs after ``runtime.warmup`` over every batch size (warm), and the steady-state
   median; the warm first batch must be faster than the cold one;
5. compute/copy overlap: a 1 GiB pinned host-to-device copy on a side stream while a bf16
   matmul loop runs on the runtime's stream, vs the two one after the other; the overlap
   ratio is the time saved over the shorter of the two (1.0 = fully hidden).

The device checks take a few minutes (most of it is starting the child processes); the
benches are planned against what is left of the budget (``benches.py``). Modules:
``children.py`` (the spawn plumbing), ``probes.py`` (what runs in a child), ``checks.py``
(judging the figures), ``benches.py`` (the benches, their plan and budget), ``cli.py`` (the
command line).
"""

from producer.tools.gpucheck.checks import CHECKS, CheckResult, run_checks
from producer.tools.gpucheck.children import CheckFailed, run_in_children
from producer.tools.gpucheck.cli import SKIP_LINE, main

__all__ = [
    "CHECKS",
    "SKIP_LINE",
    "CheckFailed",
    "CheckResult",
    "main",
    "run_checks",
    "run_in_children",
]
