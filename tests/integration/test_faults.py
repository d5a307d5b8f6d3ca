"""Failure semantics on a real stack of its own, with fault injection on.

A separate Redis and text worker (short visibility timeout, a breaker that opens after 2
failed batches and cools down in 1.5 s) so that crashing or tripping it cannot disturb the
session stack.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import FleetClient, SubmitRequest
from shared.errors import FleetError
from tests.conftest import REPO, ops_app, own_text_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__VISIBILITY_TIMEOUT_S": "2",
        "FLEET_REDIS__RESTORE_SCAN_INTERVAL_S": "0.5",
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_QUEUE_DELAY_MS": "30",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_MODALITIES__TEXT__CIRCUIT_THRESHOLD": "2",
        "FLEET_MODALITIES__TEXT__CIRCUIT_COOLDOWN_S": "1.5",
        "FLEET_MODALITIES__TEXT__RETRY_BACKOFF_S": "0.01",
    }
    with own_text_stack(tmp_path_factory, "fault-run", overrides) as st:
        yield st


@pytest.fixture(scope="module")
def fclient(fault_stack: Any) -> Iterator[FleetClient]:
    c = FleetClient(fault_stack.s)
    yield c
    c.close()


def stats(client: FleetClient) -> dict[str, Any]:
    replies = ops_app(client.settings).control.broadcast("fleet_stats", reply=True, timeout=2.0)
    return next(v for r in replies for k, v in r.items() if k.startswith("text@"))


def restart_until_final(poison: Any, fault_stack: Any, timeout_s: float) -> int:
    """Restart the text worker each time it dies until ``poison`` has failed; the restarts.

    A supervisor restarts a dead worker; so do we. It may die again right after it is up,
    on the redelivered poison: that is what these tests are about."""
    from producer.stack.local import StackError

    restarts, deadline = 0, time.monotonic() + timeout_s
    while poison.state() != "FAILURE" and time.monotonic() < deadline:
        if not fault_stack.alive("worker-text"):
            fault_stack.stop("worker-text", timeout_s=1)
            restarts += 1
            with contextlib.suppress(StackError):
                fault_stack.start_worker("text")
        time.sleep(0.1)
    return restarts


def words(i: int) -> str:
    return f"Sentence number {i} about a quiet river."


def test_transient_fault_is_retried_until_it_passes(fclient: FleetClient) -> None:
    before = stats(fclient)["retried"]
    out = fclient.submit("text", {"text": words(1), "_inject": "transient:2"}).get(30)
    assert out["dim"] == 384
    assert stats(fclient)["retried"] - before == 2


def test_transient_fault_gives_up_after_max_retries(fclient: FleetClient) -> None:
    before = stats(fclient)["retried"]
    with pytest.raises(FleetError) as err:
        fclient.submit("text", {"text": words(2), "_inject": "transient:99"}).get(30)
    assert err.value.code == "TRANSIENT"
    assert stats(fclient)["retried"] - before == fclient.settings.modality("text").max_retries


def test_bad_input_is_never_retried(fclient: FleetClient) -> None:
    before = stats(fclient)["retried"]
    with pytest.raises(FleetError) as err:
        fclient.submit("text", {"text": ""}).get(30)
    assert err.value.code == "INVALID_INPUT"
    assert stats(fclient)["retried"] == before


def _batch(fclient: FleetClient, faults: dict[int, str]) -> list[dict[str, Any] | None]:
    reqs = [
        SubmitRequest("text", {"text": words(i), **({"_inject": faults[i]} if i in faults else {})})
        for i in range(6)
    ]
    return fclient.wait_all(fclient.submit_many(reqs), timeout_s=60)


def test_model_fault_fails_alone_and_the_batch_succeeds(fclient: FleetClient) -> None:
    before = stats(fclient)["batch_sizes"]
    outs = _batch(fclient, {3: "model_error"})
    assert outs[3] is not None and outs[3]["error"]["code"] == "MODEL_ERROR"
    assert all(o is not None and "result" in o for i, o in enumerate(outs) if i != 3)
    after = stats(fclient)["batch_sizes"]
    grew = {k for k in after if after[k] > before.get(k, 0)}
    assert any(int(k) > 1 for k in grew), (before, after)  # they did run as one batch


def test_oom_batch_is_split_and_recovers(fclient: FleetClient) -> None:
    outs = _batch(fclient, {2: "oom"})  # OOM while batched, fits alone
    assert all(o is not None and "result" in o for o in outs), outs


def test_request_that_never_fits_fails_alone_with_device_oom(fclient: FleetClient) -> None:
    outs = _batch(fclient, {4: "oom_always"})
    assert outs[4] is not None and outs[4]["error"]["code"] == "DEVICE_OOM"
    assert all(o is not None and "result" in o for i, o in enumerate(outs) if i != 4)
    # The worker keeps serving afterwards.
    assert fclient.submit("text", {"text": words(9)}).get(30)["dim"] == 384


def test_circuit_opens_after_consecutive_model_faults_then_recovers(fclient: FleetClient) -> None:
    for i in range(2):  # threshold 2: two batches where everything failed
        with pytest.raises(FleetError):
            fclient.submit("text", {"text": words(i), "_inject": "model_error"}).get(30)
    with pytest.raises(FleetError) as err:
        fclient.submit("text", {"text": words(5)}).get(30)
    assert err.value.code == "CIRCUIT_OPEN"
    assert stats(fclient)["circuit"]["state"] == "open"
    time.sleep(1.6)  # the configured cool-down: the next batch is the half-open probe
    assert fclient.submit("text", {"text": words(6)}).get(30)["dim"] == 384
    assert stats(fclient)["circuit"]["state"] == "closed"


def test_poison_message_ends_as_worker_lost_and_innocents_survive(
    fclient: FleetClient, fault_stack: Any
) -> None:

    poison = fclient.submit("text", {"text": words(7), "_inject": "crash"}, priority="bulk")
    innocent = fclient.submit("text", {"text": words(8)}, priority="bulk")
    restarts = restart_until_final(poison, fault_stack, timeout_s=120)
    out = poison.outcome(timeout_s=5)
    assert out["error"]["code"] == "WORKER_LOST"
    assert restarts == 3  # three deliveries died in flight; the fourth was refused
    if not fault_stack.alive("worker-text"):
        fault_stack.start_worker("text")
    assert innocent.get(30)["dim"] == 384


def test_an_input_decoding_while_a_suspect_crashes_the_worker_is_not_blamed(
    fclient: FleetClient, fault_stack: Any
) -> None:
    """A suspect (a delivery whose worker died before) runs with no decode in progress: a
    request decoding while the suspect kills the worker did not kill it, and must not be
    counted as a death (three such counts refused an innocent request ``WORKER_LOST``)."""

    if not fault_stack.alive("worker-text"):
        fault_stack.start_worker("text")
    poison = fclient.submit("text", {"text": words(17), "_inject": "crash"}, priority="bulk")
    # Submitted right after the poison: each redelivery fetches both, and the innocent's
    # decoding (1.5 s) is under way when the poison's batch would run.
    slow = fclient.submit(
        "text", {"text": words(18), "_inject": "slow_prepare:1.5"}, priority="bulk"
    )
    restarts = restart_until_final(poison, fault_stack, timeout_s=150)
    assert poison.outcome(timeout_s=5)["error"]["code"] == "WORKER_LOST"
    assert restarts == 3
    if not fault_stack.alive("worker-text"):
        fault_stack.start_worker("text")
    assert slow.get(60)["dim"] == 384
