"""Index.merge with a region that several ranks stored (a DTensor on a sub-mesh is the same
on every rank outside that mesh): one piece is kept when the bytes agree; different bytes
fail the commit instead of committing a tensor stored twice."""

from __future__ import annotations

import pytest

from ckptd.errors import CorruptCheckpointError
from ckptd.format.layout import Region
from ckptd.format.manifest import ArrayRecord, ChunkRecord, Index, Piece, RankManifest, TensorRecord


def _manifest(rank: int, crc: int, piece_array: bool) -> RankManifest:
    region = Region((0,), (7,))
    if piece_array:  # a per-rank piece array (e.g. a strided shard), one whole chunk
        name = f"_pieces/{rank}/model/w"
        arrays = {name: ArrayRecord((7,), "float32", (7,), {"0": ChunkRecord(28, crc)})}
        piece = Piece(region, array=name, array_offsets=(0,))
        packs = {}
    else:
        arrays = {f"_packs/{rank}": ArrayRecord((64,), "uint8", (64,), {"0": ChunkRecord(64, 1)})}
        piece = Piece(region, pack=f"_packs/{rank}", byte_offset=0, nbytes=28, crc32c=crc)
        packs = {f"_packs/{rank}": 64}
    return RankManifest("j", 1, "a", rank, 2, "fsdp2", 0.0, arrays, packs,
                        {"model/w": TensorRecord((7,), "float32", [piece])})


@pytest.mark.parametrize("piece_array", [False, True])
def test_replicated_region_is_kept_once_and_diverged_replicas_fail(piece_array):
    index = Index.merge([_manifest(0, 5, piece_array), _manifest(1, 5, piece_array)])
    (piece,) = index.tensors["model/w"].pieces
    assert (piece.pack or piece.array).split("/")[1] == "0"  # the lowest rank's
    with pytest.raises(CorruptCheckpointError, match=r"tensor model/w: two ranks stored region "
                       r"offsets \[0\] shape \[7\] .* with different contents.*identical"):
        Index.merge([_manifest(0, 5, piece_array), _manifest(1, 6, piece_array)])
