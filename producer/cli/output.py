"""How results print: JSON values, arrays and tensor references as shape summaries."""

from __future__ import annotations

from typing import Any

from shared.tensor_wire import is_wire


def is_tensor_wire(obj: Any) -> bool:
    """A tensor wire object (a /dev/shm TensorRef or an inline tensor) of a result."""
    return is_wire(obj)


def jsonable(obj: Any, full: bool) -> Any:
    """``obj`` with numpy arrays as nested lists (``full``) or ``{"shape", "dtype"}``, and
    unresolved tensor wire objects as ``{"shape", "dtype"}`` (their own fields)."""
    if is_tensor_wire(obj) and not full:
        return {"shape": list(obj["shape"]), "dtype": str(obj["dtype"])}
    if isinstance(obj, dict):
        return {k: jsonable(v, full) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v, full) for v in obj]
    if hasattr(obj, "tolist") and hasattr(obj, "shape"):  # a numpy array
        return obj.tolist() if full else {"shape": list(obj.shape), "dtype": str(obj.dtype)}
    return obj
