"""zarr v3 metadata documents (``zarr.json``) for the arrays and groups ckptd writes.

Chunks are written by ckptd itself as raw little-endian C-order bytes (the zarr v3
``bytes`` codec with no compression), which any zarr v3 reader decodes.  Checksums live in
the manifests rather than in a ``crc32c`` codec: the codec pipeline copies every chunk,
which cost ~5x throughput here (see docs/FORMAT.md).
"""

from __future__ import annotations

from typing import Any

from ckptd.format.dtypes import zarr_data_type, zarr_fill_value


def array_doc(shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...]) -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zarr_data_type(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": zarr_fill_value(dtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {"ckptd": {"torch_dtype": dtype}},
        "storage_transformers": [],
    }


def group_doc(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def parent_groups(array_paths: list[str]) -> list[str]:
    """Every intermediate group path of ``array_paths`` (e.g. ``model`` for ``model/w``)."""
    groups: set[str] = set()
    for p in array_paths:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            groups.add("/".join(parts[:i]))
    return sorted(groups)
