"""OIP v2 tensors on the wire: JSON ``data`` and Triton's binary-data extension. Pure logic.

Request body: a JSON inference request, optionally followed by raw tensor bytes. With the
binary extension the ``Inference-Header-Content-Length`` header gives the JSON part's length;
each input whose ``parameters.binary_data_size`` is set takes that many bytes from what
follows, in input order. Raw layouts (little-endian, row-major):

- numeric datatypes: the elements back to back (``FP32``: 4 bytes each, ...);
- ``BYTES``: per element a 4-byte little-endian length, then that many bytes.

In JSON, ``data`` is a flat or nested row-major list; a ``BYTES`` element is a string (its
UTF-8 bytes). Responses carry outputs in JSON ``data`` or, when asked (an output's
``parameters.binary_data``, or the request's ``parameters.binary_data_output``), as raw bytes
after the JSON header (``parameters.binary_data_size`` on the output, and the response's
``Inference-Header-Content-Length``).

Errors: anything malformed raises :class:`~shared.errors.InvalidInput` (HTTP 400); never an
uncaught exception for bad input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.errors import InvalidInput

# OIP datatype -> little-endian numpy dtype (BF16 has no numpy dtype: refused).
NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
MAX_ELEMENTS = 1 << 28  # a shape whose product passes this is refused before any allocation


@dataclass(slots=True)
class InputTensor:
    """One decoded input. ``data``: a flat ``list[bytes]`` for ``BYTES``, else a numpy array
    of ``shape`` in the datatype's dtype."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """A parsed inference request (the JSON header's fields and its decoded inputs)."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[InputTensor]
    outputs: list[dict[str, Any]] | None  # requested outputs ({"name", "parameters"}), or all


def _obj(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object")
    return value


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise InvalidInput(f"input {name!r}: shape must be a list of integers >= 0")
    n = math.prod(value)
    if n > MAX_ELEMENTS:
        raise InvalidInput(f"input {name!r}: shape {value} has more than {MAX_ELEMENTS} elements")
    return tuple(value)


def _flatten(data: Any, out: list[Any], depth: int = 0) -> None:
    if depth > 32:
        raise InvalidInput("tensor data is nested more than 32 levels deep")
    for v in data:
        if isinstance(v, list):
            _flatten(v, out, depth + 1)
        else:
            out.append(v)


def parse_bytes_elements(raw: bytes | memoryview, name: str) -> list[bytes]:
    """Split a serialized ``BYTES`` tensor (4-byte LE length + bytes, per element).

    Raises:
        InvalidInput: a length runs past the end of the data.
    """
    mv = memoryview(raw)
    out: list[bytes] = []
    i, n = 0, len(mv)
    while i < n:
        if i + 4 > n:
            raise InvalidInput(f"input {name!r}: BYTES data ends inside an element's length")
        size = int.from_bytes(mv[i : i + 4], "little")
        i += 4
        if i + size > n:
            raise InvalidInput(f"input {name!r}: a BYTES element runs past the end of its data")
        out.append(bytes(mv[i : i + size]))
        i += size
    return out


def serialize_bytes_elements(elements: list[bytes]) -> bytes:
    """The binary form of a ``BYTES`` tensor (the inverse of :func:`parse_bytes_elements`)."""
    parts: list[bytes] = []
    for e in elements:
        parts.append(len(e).to_bytes(4, "little"))
        parts.append(e)
    return b"".join(parts)


def _json_numeric(values: list[Any], datatype: str, name: str) -> np.ndarray:
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise InvalidInput(f"input {name!r}: BOOL data must be true/false")
        return np.asarray(values, dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not info.min <= v <= info.max:
                raise InvalidInput(f"input {name!r}: {v!r} is not a {datatype} value")
        return np.asarray(values, dtype=dtype)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InvalidInput(f"input {name!r}: {v!r} is not a {datatype} value")
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=dtype)


def _decode_input(raw_in: Any, binary: memoryview, offset: int) -> tuple[InputTensor, int]:
    """One input object, its data from JSON ``data`` or from ``binary`` at ``offset`` (its
    ``binary_data_size``); returns the tensor and the offset past its binary data.

    Raises:
        InvalidInput: a missing or bad name, datatype, shape, size or data.
    """
    obj = _obj(raw_in, "an input")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("every input needs a non-empty string 'name'")
    datatype = obj.get("datatype")
    if datatype not in NUMPY_DTYPES and datatype != "BYTES":
        raise InvalidInput(
            f"input {name!r}: datatype {datatype!r} is not supported "
            f"(BYTES, {', '.join(NUMPY_DTYPES)})"
        )
    shape = _shape(obj.get("shape"), name)
    params = _obj(obj.get("parameters"), f"input {name!r} parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"input {name!r}: binary_data_size must be an integer >= 0")
        if "data" in obj:
            raise InvalidInput(f"input {name!r}: both 'data' and binary_data_size are given")
        if offset + size > len(binary):
            raise InvalidInput(
                f"input {name!r}: binary_data_size {size} runs past the end of the body"
            )
        data = _binary_data(binary[offset : offset + size], name, datatype, shape)
        return InputTensor(name, datatype, shape, data, params), offset + size
    if "data" not in obj:
        raise InvalidInput(f"input {name!r} has neither 'data' nor binary_data_size")
    data = _json_data(obj["data"], name, datatype, shape)
    return InputTensor(name, datatype, shape, data, params), offset


def _binary_data(chunk: memoryview, name: str, datatype: str, shape: tuple[int, ...]) -> Any:
    """A binary chunk as BYTES elements (a list of bytes) or a numpy array of ``shape``.

    Raises:
        InvalidInput: the element count or byte size does not match ``shape``.
    """
    count = math.prod(shape)
    if datatype == "BYTES":
        data = parse_bytes_elements(chunk, name)
        if len(data) != count:
            raise InvalidInput(
                f"input {name!r}: {len(data)} BYTES elements for shape {list(shape)}"
            )
        return data
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    size = len(chunk)
    if size != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: {size} bytes for shape {list(shape)} of {datatype} "
            f"(expected {count * dtype.itemsize})"
        )
    return np.frombuffer(chunk, dtype=dtype).reshape(shape)


def _json_data(raw: Any, name: str, datatype: str, shape: tuple[int, ...]) -> Any:
    """JSON ``data`` (nested lists, or a scalar for one element) as UTF-8 bytes elements or
    a numpy array of ``shape``.

    Raises:
        InvalidInput: the element count does not match ``shape``, or an element's type.
    """
    flat: list[Any] = []
    if isinstance(raw, list):
        _flatten(raw, flat)
    else:
        flat.append(raw)  # a scalar for a one-element tensor
    if len(flat) != math.prod(shape):
        raise InvalidInput(f"input {name!r}: {len(flat)} elements in data for shape {list(shape)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"input {name!r}: BYTES data in JSON must be strings")
        try:
            return [v.encode("utf-8") for v in flat]
        except UnicodeEncodeError:
            raise InvalidInput(f"input {name!r}: a string is not valid Unicode") from None
    return _json_numeric(flat, datatype, name).reshape(shape)


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Parse an inference request body (JSON, or JSON + binary tensors).

    Args:
        body: the whole HTTP body.
        header_length: the ``Inference-Header-Content-Length`` header (``None``: all JSON).

    Raises:
        InvalidInput: bad JSON, a bad header length, malformed inputs or outputs, binary
            bytes left over after the last input.
    """
    if header_length is None:
        head, binary = body, memoryview(b"")
    else:
        try:
            hl = int(header_length.strip())
        except ValueError:
            raise InvalidInput("Inference-Header-Content-Length must be an integer") from None
        if not 0 < hl <= len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length {hl} is outside the body's {len(body)} bytes"
            )
        head, binary = body[:hl], memoryview(body)[hl:]
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the request is not valid JSON: {str(exc)[:120]}") from None
    req = _obj(req, "the inference request")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInput("'id' must be a string")
    params = _obj(req.get("parameters"), "parameters")
    raw_inputs = req.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list")
    inputs: list[InputTensor] = []
    offset = 0
    for raw_in in raw_inputs:
        t, offset = _decode_input(raw_in, binary, offset)
        if any(x.name == t.name for x in inputs):
            raise InvalidInput(f"input {t.name!r} is given twice")
        inputs.append(t)
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    outputs = req.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InvalidInput("'outputs' must be a list")
        for o in outputs:
            o = _obj(o, "a requested output")
            if not isinstance(o.get("name"), str):
                raise InvalidInput("every requested output needs a string 'name'")
            _obj(o.get("parameters"), f"output {o['name']!r} parameters")
    return InferRequest(rid, params, inputs, outputs)


@dataclass(slots=True)
class OutputTensor:
    """One response output: ``FP32`` (``data`` a float32 array of its shape) or ``BYTES``
    (``data`` a list of ``bytes``, shape ``[len(data)]``)."""

    name: str
    data: Any  # np.ndarray (FP32) or list[bytes] (BYTES)
    datatype: str = "FP32"


def binary_output_names(req: InferRequest, available: list[str]) -> tuple[list[str], set[str]]:
    """Which outputs to return, in order, and which of them as binary data.

    Raises:
        InvalidInput: a requested output the model does not produce, or a non-bool
            ``binary_data`` / ``binary_data_output``.
    """
    all_binary = req.parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        raise InvalidInput("parameters.binary_data_output must be true or false")
    if req.outputs is None:
        return list(available), set(available) if all_binary else set()
    names: list[str] = []
    binary: set[str] = set()
    for o in req.outputs:
        name = o["name"]
        if name not in available:
            raise InvalidInput(
                f"output {name!r} is not produced by this model ({', '.join(available)})"
            )
        b = (o.get("parameters") or {}).get("binary_data", all_binary)
        if not isinstance(b, bool):
            raise InvalidInput(f"output {name!r}: binary_data must be true or false")
        if name not in names:
            names.append(name)
        if b:
            binary.add(name)
    return names, binary


def encode_response(
    header: dict[str, Any], outputs: list[OutputTensor], binary: set[str]
) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the JSON header's length (for the
    ``Inference-Header-Content-Length`` header; ``None``: the body is all JSON)."""
    blobs: list[bytes] = []
    outs: list[dict[str, Any]] = []
    for o in outputs:
        entry: dict[str, Any]
        if o.datatype == "BYTES":
            elements = [bytes(e) for e in o.data]
            entry = {"name": o.name, "datatype": "BYTES", "shape": [len(elements)]}
            raw = serialize_bytes_elements(elements)
            data: list[Any] = [e.decode("utf-8") for e in elements]
        else:
            arr = np.ascontiguousarray(o.data, dtype="<f4")
            entry = {"name": o.name, "datatype": "FP32", "shape": list(arr.shape)}
            raw = arr.tobytes() if o.name in binary else b""
            data = arr.reshape(-1).tolist()
        if o.name in binary:
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = data
        outs.append(entry)
    head = json.dumps({**header, "outputs": outs}, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
