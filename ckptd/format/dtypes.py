"""How torch dtypes are stored as zarr v3 data types.

zarr-python 3.1 has no bfloat16 or float8 data types, so those are stored as raw
little-endian words of the same width (``uint16`` / ``uint8``) and the torch dtype is
recorded in the array's ``attributes.ckptd.torch_dtype`` and in the index.  Any reader
can reinterpret the words (``numpy.view``/``torch.view``) bit-exactly.
"""

from __future__ import annotations

import torch

from ckptd.errors import CorruptCheckpointError

# torch dtype -> (zarr v3 data_type, fill_value)
_ZARR: dict[torch.dtype, tuple[str, object]] = {
    torch.float64: ("float64", 0.0),
    torch.float32: ("float32", 0.0),
    torch.float16: ("float16", 0.0),
    torch.bfloat16: ("uint16", 0),
    torch.int64: ("int64", 0),
    torch.int32: ("int32", 0),
    torch.int16: ("int16", 0),
    torch.int8: ("int8", 0),
    torch.uint8: ("uint8", 0),
    torch.bool: ("bool", False),
    torch.complex64: ("complex64", [0.0, 0.0]),
    torch.complex128: ("complex128", [0.0, 0.0]),
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _ZARR[getattr(torch, _name)] = (_name, 0)
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _ZARR[getattr(torch, _name)] = ("uint8", 0)

_BY_NAME: dict[str, torch.dtype] = {str(dt).removeprefix("torch."): dt for dt in _ZARR}


def dtype_name(dtype: torch.dtype) -> str:
    """The name recorded in manifests, e.g. ``bfloat16``."""
    if dtype not in _ZARR:
        raise TypeError(
            f"ckptd cannot store tensors of dtype {dtype}; supported: {sorted(_BY_NAME)}"
        )
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype recorded as ``name``; CorruptCheckpointError if unknown."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(
            f"checkpoint records dtype {name!r}, which this torch build does not know; expected "
            f"one of {sorted(_BY_NAME)}. Load with a torch version that has it."
        ) from None


def zarr_data_type(dtype: torch.dtype) -> str:
    return _ZARR[dtype][0]


def zarr_fill_value(dtype: torch.dtype) -> object:
    return _ZARR[dtype][1]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
