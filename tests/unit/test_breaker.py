"""``workers.batching.execution``: the circuit breaker, as the batch runner reads it and as
:func:`~workers.batching.execution.judge_breaker` judges a batch, without Redis or Celery.

A fake model (``engine_fakes.Doubler``: ``y = 2 * x``, misbehaving on chosen inputs) and
fake requests; the runner and the breaker are the real ones. The clock is moved by hand;
nothing sleeps.
"""

from __future__ import annotations

from engine_fakes import Doubler, codes, finals, rig, work

from shared.errors import CircuitOpen, DeviceOOM, ModelError
from workers.batching.completion import Done, Outcome, Started
from workers.batching.execution import CircuitBreaker, State, judge_breaker


def test_the_circuit_opens_after_failed_batches_and_fails_fast_without_the_model() -> None:
    r = rig(Doubler(), breaker=CircuitBreaker(threshold=2, cooldown_s=10.0))
    for i in range(2):
        r.runner.run([work(f"p{i}", "poison", r.adapter)], None)
    assert r.breaker.state is State.OPEN
    calls = len(r.adapter.calls)
    r.runner.run([work("a", 1, r.adapter), work("b", 2, r.adapter)], None)
    assert len(r.adapter.calls) == calls  # the model was not called
    assert codes(r)["a"] == codes(r)["b"] == "CIRCUIT_OPEN"
    assert isinstance(finals(r)["a"].error, CircuitOpen)
    assert not any(isinstance(i, Started) and i.batch[0].req.id == "a" for i in r.posted)


def test_after_the_cooldown_one_probe_runs_and_its_success_closes_the_circuit() -> None:
    r = rig(Doubler(), breaker=CircuitBreaker(threshold=1, cooldown_s=10.0))
    r.runner.run([work("p", "poison", r.adapter)], None)
    r.clock.now += 9.9
    r.runner.run([work("early", 1, r.adapter)], None)
    assert codes(r)["early"] == "CIRCUIT_OPEN"
    r.clock.now += 0.1
    r.runner.run([work("probe", 3, r.adapter)], None)
    assert finals(r)["probe"].result == {"y": 6}
    assert r.breaker.state is State.CLOSED


def test_a_failed_probe_opens_the_circuit_for_another_cooldown() -> None:
    r = rig(Doubler(), breaker=CircuitBreaker(threshold=3, cooldown_s=10.0))
    for i in range(3):
        r.runner.run([work(f"p{i}", "poison", r.adapter)], None)
    r.clock.now += 10.0
    r.runner.run([work("probe", "poison", r.adapter)], None)
    assert codes(r)["probe"] == "MODEL_ERROR"  # the probe ran
    assert r.breaker.state is State.OPEN and r.breaker.opened_at == r.clock.now
    r.clock.now += 5.0
    r.runner.run([work("later", 1, r.adapter)], None)
    assert codes(r)["later"] == "CIRCUIT_OPEN"


def test_bad_input_never_opens_the_circuit() -> None:
    r = rig(Doubler(), breaker=CircuitBreaker(threshold=2, cooldown_s=10.0))
    for i in range(5):
        r.runner.run([work(f"b{i}", "bad", r.adapter)], None)
        r.runner.run([work(f"u{i}", "undecodable", r.adapter)], None)
    assert r.breaker.state is State.CLOSED and r.breaker.failures == 0


def test_one_success_in_a_batch_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(threshold=2, cooldown_s=10.0)
    fault = Done(None, None, Outcome("x", error=ModelError("boom")))
    judge_breaker(breaker, [fault], 1.0)
    assert breaker.failures == 1
    judge_breaker(breaker, [fault, Done(None, None, Outcome("y", result={}))], 2.0)
    assert breaker.failures == 0 and breaker.state is State.CLOSED
    judge_breaker(breaker, [Done(None, None, Outcome("z", error=DeviceOOM("big")))], 3.0)
    judge_breaker(breaker, [fault], 4.0)
    assert breaker.state is State.OPEN and breaker.opened_at == 4.0
