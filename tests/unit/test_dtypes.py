"""The dtype table the format layer uses without torch agrees with torch."""

from __future__ import annotations

import pytest
import torch

from ckptd.errors import CorruptCheckpointError
from ckptd.format import dtypes


@pytest.mark.parametrize("name", dtypes.SUPPORTED)
def test_name_table_agrees_with_torch(name):
    dt = getattr(torch, name, None)
    if dt is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    assert dtypes.dtype_name(dt) == name == dtypes.dtype_name(name)
    assert dtypes.dtype_from_name(name) is dt
    assert dtypes.itemsize(name) == dtypes.itemsize(dt) == torch.empty((), dtype=dt).element_size()
    assert dtypes.zarr_data_type(name) == dtypes.zarr_data_type(dt)


def test_unknown_names_and_dtypes_are_clear_errors():
    with pytest.raises(CorruptCheckpointError, match="'float128'.*expected one of"):
        dtypes.itemsize("float128")
    with pytest.raises(CorruptCheckpointError, match="'float4'"):
        dtypes.dtype_from_name("float4")
    # a torch dtype ckptd cannot store is a user error, not corruption
    quint = getattr(torch, "quint8")
    with pytest.raises(TypeError, match="cannot store tensors of dtype torch.quint8"):
        dtypes.dtype_name(quint)
    with pytest.raises(TypeError):
        dtypes.itemsize(quint)
