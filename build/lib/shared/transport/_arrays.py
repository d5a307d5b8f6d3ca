"""Turn what a caller hands the transport (numpy array or torch tensor) into a plain array.

torch is never imported here: a tensor is recognised by duck typing (``detach``, ``cpu`` and
``numpy`` methods), so producers that only send numpy arrays never load it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from shared.errors import InvalidInput
from shared.transport.ref import ALLOWED_DTYPES

# The segment and inline formats store raw little-endian bytes (what every host this fleet
# targets uses). A big-endian host would need a byte swap on both sides; refuse instead.
if sys.byteorder != "little":  # pragma: no cover - no such host in the fleet
    raise ImportError("shared.transport supports little-endian hosts only")


def _is_torch_tensor(obj: object) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("detach", "cpu", "numpy"))


def as_c_array(obj: Any) -> np.ndarray:
    """A C-contiguous, native-byte-order numpy array with the data of ``obj``.

    Args:
        obj: a ``numpy.ndarray``, a numpy scalar, or a torch tensor (any device; it is
            detached and moved to the CPU, which copies only if it is not already there).

    Returns:
        The array itself when it already qualifies (no copy); otherwise one contiguous copy
        (non-contiguous views, Fortran order, or a non-native byte order).

    Raises:
        InvalidInput: another type, or a dtype outside ``ALLOWED_DTYPES`` (bfloat16, complex,
            strings, objects, ...).
    """
    if isinstance(obj, np.ndarray | np.generic):
        arr = np.asarray(obj)
    elif _is_torch_tensor(obj):
        try:
            arr = obj.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. bfloat16 has no numpy dtype
            raise InvalidInput(
                f"cannot convert a tensor of dtype {getattr(obj, 'dtype', '?')} to numpy "
                f"({exc}); use one of {sorted(ALLOWED_DTYPES)}"
            ) from None
    else:
        raise InvalidInput(f"expected a numpy array or torch tensor, got {type(obj).__name__}")
    name = arr.dtype.name
    if name not in ALLOWED_DTYPES or arr.dtype.fields is not None:
        raise InvalidInput(
            f"dtype {arr.dtype!s} is not supported; use one of {sorted(ALLOWED_DTYPES)}"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.flags.c_contiguous:
        return arr
    # Not np.ascontiguousarray alone: it turns a 0-d array into shape (1,).
    return np.ascontiguousarray(arr).reshape(arr.shape)
