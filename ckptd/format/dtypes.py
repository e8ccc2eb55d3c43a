"""How torch dtypes are stored as zarr v3 data types.

zarr-python 3.1 has no bfloat16 or float8 data types, so those are stored as raw
little-endian words of the same width (``uint16`` / ``uint8``) and the torch dtype is
recorded in the array's ``attributes.ckptd.torch_dtype`` and in the index.  Any reader
can reinterpret the words (``numpy.view``/``torch.view``) bit-exactly.

The format layer names dtypes by the strings it records (``"bfloat16"``), so everything
that only plans, verifies or copies bytes (the tools, reshard, the daemon) works without
importing torch.  Functions that take a ``dtype`` accept either a ``torch.dtype`` or its
recorded name; only :func:`dtype_from_name` imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ckptd.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

#: a ``torch.dtype`` or the name recorded for it (``"bfloat16"``)
DType = Union["torch.dtype", str]

# recorded name (= the torch attribute name) -> (zarr v3 data_type, fill_value, bytes/element)
_TABLE: dict[str, tuple[str, object, int]] = {
    "float64": ("float64", 0.0, 8),
    "float32": ("float32", 0.0, 4),
    "float16": ("float16", 0.0, 2),
    "bfloat16": ("uint16", 0, 2),
    "int64": ("int64", 0, 8),
    "int32": ("int32", 0, 4),
    "int16": ("int16", 0, 2),
    "int8": ("int8", 0, 1),
    "uint8": ("uint8", 0, 1),
    "uint16": ("uint16", 0, 2),
    "uint32": ("uint32", 0, 4),
    "uint64": ("uint64", 0, 8),
    "bool": ("bool", False, 1),
    "complex64": ("complex64", [0.0, 0.0], 8),
    "complex128": ("complex128", [0.0, 0.0], 16),
    "float8_e4m3fn": ("uint8", 0, 1),
    "float8_e5m2": ("uint8", 0, 1),
    "float8_e4m3fnuz": ("uint8", 0, 1),
    "float8_e5m2fnuz": ("uint8", 0, 1),
    "float8_e8m0fnu": ("uint8", 0, 1),
}

SUPPORTED: tuple[str, ...] = tuple(sorted(_TABLE))


def dtype_name(dtype: DType) -> str:
    """The name recorded in manifests, e.g. ``bfloat16``; TypeError if ckptd cannot store it."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _TABLE:
        raise TypeError(
            f"ckptd cannot store tensors of dtype {dtype}; supported: {list(SUPPORTED)}"
        )
    return name


def check_name(name: str) -> str:
    """``name`` if it is a dtype name this version knows; CorruptCheckpointError otherwise.

    For names read from storage (manifests, indexes).
    """
    if name not in _TABLE:
        raise CorruptCheckpointError(
            f"checkpoint records dtype {name!r}; expected one of {list(SUPPORTED)}. It was "
            "written by a newer ckptd or is damaged: read it with the ckptd version that wrote it."
        )
    return name


def _entry(dtype: DType) -> tuple[str, object, int]:
    if isinstance(dtype, str):
        return _TABLE[check_name(dtype)]
    return _TABLE[dtype_name(dtype)]


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype recorded as ``name``; CorruptCheckpointError if unknown."""
    import torch

    dt = getattr(torch, check_name(name), None)
    if not isinstance(dt, torch.dtype):
        raise CorruptCheckpointError(
            f"checkpoint records dtype {name!r}, which torch {torch.__version__} does not "
            "have; load it with a torch version that has it."
        )
    return dt


def zarr_data_type(dtype: DType) -> str:
    return _entry(dtype)[0]


def zarr_fill_value(dtype: DType) -> object:
    return _entry(dtype)[1]


def itemsize(dtype: DType) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a recorded name)."""
    return _entry(dtype)[2]
