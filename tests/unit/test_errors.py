"""``shared.errors``: stable codes, rebuilding, retry policy; and the code's trip through a
stored Celery result (``workers.batching.completion`` -> Celery's JSON -> ``producer.client``)."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
from celery import Celery

from producer.client import outcome_from_meta
from shared import errors
from shared.errors import ERROR_CLASSES, FleetError, TransientError, error_from_code
from workers.batching.completion import Outcome, ResultWriter, exception_dict

# The released codes: part of the public contract, never renamed (adding is fine).
RELEASED = {
    "FLEET_ERROR": errors.FleetError,
    "INVALID_INPUT": errors.InvalidInput,
    "UNSUPPORTED_MODALITY": errors.UnsupportedModality,
    "INVALID_PRIORITY": errors.InvalidPriority,
    "PAYLOAD_TOO_LARGE": errors.PayloadTooLarge,
    "IMAGE_DECODE": errors.ImageDecodeError,
    "VIDEO_DECODE": errors.VideoDecodeError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceeded,
    "QUEUE_FULL": errors.QueueFull,
    "TRANSPORT_ERROR": errors.TransportError,
    "SHM_CAPACITY": errors.ShmCapacityError,
    "TENSOR_REF_INVALID": errors.TensorRefError,
    "TRANSIENT": errors.TransientError,
    "WORKER_LOST": errors.WorkerLost,
    "MODEL_ERROR": errors.ModelError,
    "CIRCUIT_OPEN": errors.CircuitOpen,
    "DEVICE_ERROR": errors.DeviceError,
    "DEVICE_OOM": errors.DeviceOOM,
    "BROKER_UNAVAILABLE": errors.BrokerUnavailable,  # raised by producers, never stored
}


def all_error_classes() -> list[type[FleetError]]:
    """Every FleetError subclass of ``shared.errors``, found independently of ERROR_CLASSES
    (the gateway's HTTP-only refusals subclass it elsewhere and are not stored codes; had
    another test module imported them first, they would be found too)."""
    found: list[type[FleetError]] = []
    todo: list[type[FleetError]] = [FleetError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == errors.__name__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


ALL = all_error_classes()


def result_app() -> Celery:
    """A Celery app whose JSON result backend lives in memory (no Redis)."""
    app = Celery("errors-test", backend="cache+memory://", set_as_current=False)
    app.conf.update(result_serializer="json", result_accept_content=["json"])
    return app


# -- codes ------------------------------------------------------------------------------


def test_every_class_has_its_own_code() -> None:
    codes = [cls.code for cls in ALL]
    assert len(codes) == len(set(codes))


def test_codes_are_upper_snake_case() -> None:
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", cls.code) for cls in ALL)


def test_error_classes_maps_every_code_to_its_class() -> None:
    expected = {cls.code: cls for cls in ALL}
    assert expected == ERROR_CLASSES


@pytest.mark.parametrize(("code", "cls"), sorted(RELEASED.items()))
def test_released_code_is_unchanged(code: str, cls: type[FleetError]) -> None:
    assert cls.code == code
    assert ERROR_CLASSES[code] is cls


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_error_from_code_rebuilds_the_subclass(cls: type[FleetError]) -> None:
    err = error_from_code(cls.code, "why")
    assert type(err) is cls
    assert (err.code, err.message) == (cls.code, "why")


def test_unknown_code_gives_fleet_error_with_that_code() -> None:
    err = error_from_code("SOMETHING_NEW", "from a newer worker")
    assert type(err) is FleetError
    assert err.code == "SOMETHING_NEW"
    assert err.args == ("from a newer worker", "SOMETHING_NEW")
    assert FleetError.code == "FLEET_ERROR"  # the instance override does not leak


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_args_are_message_and_code(cls: type[FleetError]) -> None:
    assert cls("bad thing").args == ("bad thing", cls.code)


def test_str_and_to_dict_carry_the_code() -> None:
    err = errors.ImageDecodeError("not an image")
    assert str(err) == "[IMAGE_DECODE] not an image"
    assert err.to_dict() == {
        "code": "IMAGE_DECODE",
        "message": "not an image",
        "type": "ImageDecodeError",
    }


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_only_transient_errors_are_retryable(cls: type[FleetError]) -> None:
    assert cls.retryable is issubclass(cls, TransientError)


def test_input_errors_are_not_retryable_and_transient_is() -> None:
    assert errors.TransientError.retryable is True
    assert errors.InvalidInput.retryable is False
    assert errors.PayloadTooLarge.retryable is False
    assert errors.WorkerLost.retryable is False


@pytest.mark.parametrize(
    "err",
    [errors.DeviceOOM("too big"), error_from_code("SOMETHING_NEW", "m")],
    ids=["known", "unknown-code"],
)
def test_error_survives_pickling(err: FleetError) -> None:
    # The prefork pool pickles exceptions raised in its child processes.
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.code, back.message, back.args) == (err.code, err.message, err.args)


# -- the code through a stored result ---------------------------------------------------


def test_exception_dict_is_celerys_json_encoding_with_the_code() -> None:
    assert exception_dict(errors.ImageDecodeError("bad bytes")) == {
        "exc_type": "ImageDecodeError",
        "exc_message": ["bad bytes", "IMAGE_DECODE"],
        "exc_module": "shared.errors",
    }


def test_outcome_from_raw_failure_meta() -> None:
    meta = {
        "status": "FAILURE",
        "result": exception_dict(errors.DeadlineExceeded("late by 3 ms")),
    }
    assert outcome_from_meta(meta) == {
        "error": {
            "code": "DEADLINE_EXCEEDED",
            "message": "late by 3 ms",
            "type": "DeadlineExceeded",
        }
    }


def test_outcome_from_success_meta() -> None:
    assert outcome_from_meta({"status": "SUCCESS", "result": {"dim": 384}}) == {
        "result": {"dim": 384}
    }


def test_outcome_from_decoded_fleet_error() -> None:
    meta = {"status": "FAILURE", "result": errors.QueueFull("full")}
    assert outcome_from_meta(meta)["error"] == {
        "code": "QUEUE_FULL",
        "message": "full",
        "type": "QueueFull",
    }


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (RuntimeError("boom", "SOME_CODE"), "SOME_CODE", "boom"),
        (RuntimeError("boom"), "FLEET_ERROR", "boom"),
    ],
)
def test_outcome_from_foreign_exception(exc: BaseException, code: str, message: str) -> None:
    out = outcome_from_meta({"status": "FAILURE", "result": exc})
    assert out["error"] == {"code": code, "message": message, "type": "RuntimeError"}


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome("t-ok", result={"dim": 384}),
        Outcome("t-bad", error=errors.ImageDecodeError("bad bytes")),
        Outcome("t-new", error=error_from_code("SOMETHING_NEW", "from a newer worker")),
    ],
    ids=["success", "known-error", "unknown-code"],
)
def test_result_meta_round_trips_through_celery_json(outcome: Outcome) -> None:
    app = result_app()
    meta = ResultWriter(app).meta(outcome)
    assert meta["status"] == outcome.state
    assert meta["task_id"] == outcome.task_id
    decoded = app.backend.decode_result(app.backend.encode(meta))
    got = outcome_from_meta(decoded)
    if outcome.error is None:
        assert got == {"result": outcome.result}
    else:
        assert got == {"error": outcome.error.to_dict()}


@pytest.mark.parametrize(
    "meta",
    [{"status": "FAILURE", "result": None}, {"status": "REVOKED", "result": "revoked"}],
)
def test_every_error_outcome_has_code_message_and_type(meta: dict[str, Any]) -> None:
    assert set(outcome_from_meta(meta)["error"]) == {"code", "message", "type"}


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (errors.error_to_wire(errors.QueueFull("full")), ("QUEUE_FULL", "full", "QueueFull")),
        ({"exc_type": "KeyError", "exc_message": ["k"]}, (None, "k", "KeyError")),
        ({"exc_type": "X", "exc_message": "flat"}, (None, "flat", "X")),
        ({"exc_message": ["m", 7]}, (None, "m", "")),
        ({"exc_type": "E", "exc_message": []}, (None, None, "E")),
    ],
    ids=["fleet", "foreign", "not-a-list", "non-str-code", "no-args"],
)
def test_error_wire_form_is_read_on_one_rule(
    wire: dict[str, Any], expected: tuple[str | None, str | None, str]
) -> None:
    assert errors.is_error_wire(wire)
    assert tuple(errors.error_from_wire(wire)) == expected
