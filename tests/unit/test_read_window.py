"""The reader's read-window path (unit): a backend that offers a window gets batched reads
into reserved room, the results are bit-exact with plain ``get`` reads for any window size
(fetches that do not fit go through ``get``), every reservation is given back, errors name
the damaged object; the client's range allocator and its fallback to the stream."""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import torch
from ckptd_client import CheckpointClient
from ckptd_client.transport.shmread import RangeAllocator, SegmentWindow

from ckptd.errors import ConfigError, CorruptCheckpointError
from ckptd.format import paths
from ckptd.format.commit import read_index, resolve_step
from ckptd.format.reader import CheckpointReader, ReadWindow, WindowRead
from ckptd.storage import LocalBackend


# -- the allocator ---------------------------------------------------------------------------
def test_allocator_first_fit_merges_and_refuses_double_release():
    a = RangeAllocator(1024, align=64)
    assert a.take(0) == 0 and a.in_use == 0
    x, y, z = a.take(100), a.take(64), a.take(1)
    assert (x, y, z) == (0, 128, 192) and a.in_use == 256
    assert a.take(1024) is None
    a.give(y, 64)
    assert a.take(65) == 256          # the 64-byte hole does not fit 65 bytes
    assert a.take(64) == 128          # ... but 64 fits it again (first fit)
    a.give(x, 100)
    a.give(128, 64)
    a.give(z, 1)
    a.give(256, 65)
    assert a.in_use == 0 and a.take(1024) == 0   # merged back into one run
    a.give(0, 1024)
    with pytest.raises(RuntimeError, match="free already"):
        a.give(0, 64)
    with pytest.raises(RuntimeError, match="outside"):
        a.give(1000, 64)


def test_allocator_against_a_model():
    rng = random.Random(5)
    a = RangeAllocator(4096, align=16)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.45:
            off = rng.choice(list(held))
            a.give(off, held.pop(off))
        else:
            n = rng.randint(1, 700)
            off = a.take(n)
            if off is None:
                continue
            span = -(-n // 16) * 16
            assert off % 16 == 0 and off + span <= 4096
            for o, m in held.items():   # never overlaps anything held
                assert off + span <= o or o + -(-m // 16) * 16 <= off
            held[off] = n
        assert a.in_use == sum(-(-m // 16) * 16 for m in held.values())


# -- the reader with a window -------------------------------------------------------------
class FakeWindow(ReadWindow):
    """An in-process window over a bytearray, filled with ``get_into``."""

    def __init__(self, storage: LocalBackend, capacity: int, batch_items: int) -> None:
        self.storage = storage
        self.capacity = capacity
        self.max_batch_bytes = max(1, capacity // 4)
        self.max_batch_items = batch_items
        self.buf = bytearray(capacity)
        self.alloc = RangeAllocator(capacity, align=64)
        self.fills: list[int] = []
        self.closed = False

    def reserve(self, nbytes: int) -> int | None:
        off = self.alloc.take(nbytes)
        assert off is None or off + nbytes <= self.capacity
        return off

    def release(self, offset: int, nbytes: int) -> None:
        self.alloc.give(offset, nbytes)

    def fill(self, reads: Sequence[WindowRead]) -> list[memoryview | int | None]:
        assert not self.closed and len(reads) <= self.max_batch_items
        self.fills.append(len(reads))
        out: list[memoryview | int | None] = []
        for r in reads:
            try:
                if r.whole:
                    size = self.storage.size(r.key)
                    if size != r.nbytes:
                        out.append(size)
                        continue
                view = memoryview(self.buf)[r.offset:r.offset + r.nbytes]
                n = self.storage.get_into(r.key, view, r.start)
                out.append(view[:n])
            except FileNotFoundError:
                out.append(None)
        return out

    def close(self) -> None:
        self.closed = True


class WindowedBackend(LocalBackend):
    """A local backend that offers FakeWindows of a fixed capacity and counts gets."""

    def __init__(self, root: str, capacity: int, batch_items: int = 1024) -> None:
        super().__init__(root)
        self.window_capacity = capacity
        self.batch_items = batch_items
        self.windows: list[FakeWindow] = []
        self.gets = 0

    def read_window(self, capacity: int) -> FakeWindow:
        w = FakeWindow(self, self.window_capacity, self.batch_items)
        self.windows.append(w)
        return w

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.gets += 1
        return super().get(key, start, end)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("win"))
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200),
                            torch.nn.Linear(200, 100))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 300)).sum().backward()
    opt.step()
    client = CheckpointClient("w", storage=f"file://{root}", pack_threshold=4096)
    client.save(m, optimizer=opt, step=1)
    client.close()
    storage = LocalBackend(root)
    rec = resolve_step(storage, "w", None)
    index = read_index(storage, rec)
    reader = CheckpointReader(storage, index, paths.attempt_prefix("w", 1, rec.attempt))
    want = {n: reader.read_region(n) for n in index.tensors}
    return root, want


def _read_all(storage: Any, names: Sequence[str] | None = None) -> tuple[
        CheckpointReader, dict[str, torch.Tensor]]:
    rec = resolve_step(storage, "w", None)
    index = read_index(storage, rec)
    reader = CheckpointReader(storage, index, paths.attempt_prefix("w", 1, rec.attempt),
                              max_inflight_bytes=1 << 20)
    from ckptd.format.dtypes import dtype_from_name
    from ckptd.format.items import LoadTarget

    outs = {n: torch.empty(index.tensors[n].shape, dtype=dtype_from_name(index.tensors[n].dtype))
            for n in (index.tensors if names is None else names)}
    reader.read_targets([LoadTarget(n, tuple(o.shape), o.dtype, o) for n, o in outs.items()])
    return reader, outs


@pytest.mark.parametrize("capacity,batch_items", [
    (64, 1024),            # smaller than nearly every fetch: those go through get
    (4096, 3),             # small batches, room runs out often
    (300 * 1024, 2),
    (8 << 20, 1024),       # everything fits
])
def test_window_reads_are_bit_exact_and_give_every_reservation_back(saved, capacity,
                                                                    batch_items):
    root, want = saved
    storage = WindowedBackend(root, capacity, batch_items)
    reader, got = _read_all(storage)
    for n, t in want.items():
        assert torch.equal(got[n].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), n
    (w,) = storage.windows
    assert w.alloc.in_use == 0
    if capacity >= 4096:
        assert sum(w.fills) > 0
    if capacity == 8 << 20:
        assert max(w.fills) > 1            # several fetches per batch
    reader.close()
    assert w.closed
    reader.close()                         # idempotent


def test_window_errors_name_the_object_and_release_the_room(saved, tmp_path):
    root, _ = saved
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    storage = WindowedBackend(copy, 8 << 20)
    rec = resolve_step(storage, "w", None)
    prefix = paths.attempt_prefix("w", 1, rec.attempt)
    chunk = os.path.join(copy, prefix, "model", "0.weight", "c", "0", "0")
    assert os.path.exists(chunk), os.listdir(os.path.join(copy, prefix, "model"))
    with open(chunk, "ab") as f:            # one byte too many: not the recorded size
        f.write(b"x")
    with pytest.raises(CorruptCheckpointError, match="expected 240000 bytes, found 240001"):
        _read_all(storage)
    assert storage.windows[-1].alloc.in_use == 0
    os.unlink(chunk)
    with pytest.raises(CorruptCheckpointError, match="missing from storage"):
        _read_all(storage)
    assert storage.windows[-1].alloc.in_use == 0


# -- the client's shared-memory window: fallback to the stream ---------------------------
class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "test"

    def trailing_metadata(self) -> tuple:
        return ()


def _segment_window(call: Any, stream: dict[str, bytes]) -> SegmentWindow:
    mm = mmap.mmap(-1, 1 << 20)
    counts: dict[str, int] = {}
    released = []

    def stream_get(key: str, start: int | None, end: int | None) -> bytes:
        if key not in stream:
            raise FileNotFoundError(key)
        return stream[key][start or 0:end]

    w = SegmentWindow(session_id="s", segment_id="g", mm=mm, address="unix:///x", call=call,
                      stream_get=stream_get,
                      count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n),
                      release=lambda: released.append(True))
    w.counts, w.released = counts, released  # type: ignore[attr-defined]
    return w


def test_segment_window_falls_back_to_the_stream_when_the_daemon_forgot_it():
    calls = []

    def gone(req: Any) -> Any:
        calls.append(req)
        raise _RpcError(grpc.StatusCode.NOT_FOUND)   # session unknown (daemon restarted)

    w = _segment_window(gone, {"j/a": b"0123456789", "j/b": b"abc"})
    reads = [WindowRead("j/a", 2, 4, 0, False), WindowRead("j/b", 0, 3, 64, True),
             WindowRead("j/none", 0, 3, 128, True)]
    got = w.fill(reads)
    assert [bytes(g) if g is not None else None for g in got] == [b"2345", b"abc", None]
    assert w.fallback and len(calls) == 1
    w.fill(reads)
    assert len(calls) == 1                   # no further shared-memory attempts
    w.close()
    w.close()
    assert w.released == [True]              # type: ignore[attr-defined]


def test_segment_window_places_views_and_raises_refusals():
    def placed(req: Any) -> Any:
        from ckptd.v1 import ckptd_pb2 as pb

        return pb.ReadIntoSegmentResponse(nbytes=[4, -1, 7])

    w = _segment_window(placed, {})
    got = w.fill([WindowRead("j/a", 0, 4, 0, False), WindowRead("j/b", 0, 3, 64, True),
                  WindowRead("j/c", 0, 5, 128, True)])
    assert isinstance(got[0], memoryview) and len(got[0]) == 4
    assert got[1] is None and got[2] == 7     # absent; whole object of another size
    assert w.counts == {"shared_memory": 4}   # type: ignore[attr-defined]
    del got
    w.close()

    def refused(req: Any) -> Any:
        raise _RpcError(grpc.StatusCode.INVALID_ARGUMENT)

    w = _segment_window(refused, {"j/a": b"x"})
    with pytest.raises(ConfigError):
        w.fill([WindowRead("j/a", 0, 1, 0, False)])
    assert w.fallback is None
    w.close()


def test_stream_read_is_tried_again_when_its_connection_broke():
    """ReadObject on a connection that broke (the daemon restarted under the call) fails
    UNAVAILABLE; DaemonStorage.get tries it again, and gives up after a few tries."""
    from types import SimpleNamespace

    from ckptd_client.transport.daemon import STREAM_READ_ATTEMPTS, DaemonStorage

    from ckptd.errors import DaemonUnavailableError
    from ckptd.v1 import ckptd_pb2 as pb

    calls = []

    def read_object(req: Any, **kw: Any) -> Any:
        calls.append(req.key)
        if len(calls) < 3:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE)
        return iter([pb.ReadObjectResponse(data=b"ab"), pb.ReadObjectResponse(data=b"c")])

    t = SimpleNamespace(url="file:///x", job="j", address="unix:///x", _md=(),
                        _stub=SimpleNamespace(ReadObject=read_object))
    storage = DaemonStorage(t)  # type: ignore[arg-type]
    assert storage.get("j/k") == b"abc" and calls == ["j/k"] * 3
    assert storage.read_bytes["stream"] == 3
    calls.clear()

    def down(req: Any, **kw: Any) -> Any:
        calls.append(req.key)
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)

    t._stub.ReadObject = down
    with pytest.raises(DaemonUnavailableError, match="not reachable"):
        storage.get("j/k")
    assert len(calls) == STREAM_READ_ATTEMPTS
    calls.clear()

    def refused(req: Any, **kw: Any) -> Any:
        calls.append(req.key)
        raise _RpcError(grpc.StatusCode.INVALID_ARGUMENT)

    t._stub.ReadObject = refused
    with pytest.raises(ConfigError):
        storage.get("j/k")
    assert len(calls) == 1                    # only a broken connection is tried again


@pytest.fixture(scope="module")
def many_small(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A checkpoint of 60 small parameters and their AdamW state: 241 packed entries."""
    root = str(tmp_path_factory.mktemp("many"))
    torch.manual_seed(4)
    m = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(60))
    opt = torch.optim.AdamW(m.parameters())
    sum(p.sum() for p in m.parameters()).backward()
    opt.step()
    client = CheckpointClient("w", storage=f"file://{root}")
    client.save(m, optimizer=opt, step=1)
    client.close()
    want = dict(m.state_dict(prefix="model/"))
    for i, p in enumerate(m.parameters()):
        for k, v in opt.state[p].items():
            want[f"optim/{i}.weight/{k}"] = v
    return root, want


@pytest.mark.parametrize("capacity", [0, 8 << 20])
def test_packed_entries_close_together_are_read_with_one_storage_call(many_small, capacity):
    """Packed entries lie side by side in the rank's pack object: they are fetched as one
    range (each still verified against its own checksum), not one call per entry."""
    root, want = many_small
    storage = WindowedBackend(root, capacity) if capacity else WindowedBackend(root, 1)
    reader, got = _read_all(storage, list(want))    # in the model's order, as load reads
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    packed = sum(1 for t in reader.index.tensors.values() for p in t.pieces if p.pack)
    assert packed > 200
    calls = storage.gets + sum(sum(w.fills) for w in storage.windows)
    assert calls <= 3, calls   # COMMITTED, index.json, the pack (one per entry before)
    assert all(w.alloc.in_use == 0 for w in storage.windows)
    reader.close()


@pytest.mark.parametrize("capacity", [0, 8 << 20])
def test_a_damaged_or_truncated_entry_of_a_shared_read_is_named(many_small, tmp_path, capacity):
    root, want = many_small
    names = list(want)
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    storage = WindowedBackend(copy, capacity) if capacity else WindowedBackend(copy, 1)
    rec = resolve_step(storage, "w", None)
    index = read_index(storage, rec)
    p = index.tensors["model/30.weight"].pieces[0]
    assert p.pack is not None and p.byte_offset
    pack = os.path.join(copy, paths.attempt_prefix("w", 1, rec.attempt), p.pack, "c", "0")
    with open(pack, "r+b") as f:
        f.seek(p.byte_offset + 5)
        byte = f.read(1)
        f.seek(p.byte_offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=(
            rf"checksum mismatch in pack '_packs/0' bytes \[{p.byte_offset}, "
            rf"{p.byte_offset + p.nbytes}\)")):
        _read_all(storage, names)
    assert all(w.alloc.in_use == 0 for w in storage.windows)
    os.truncate(pack, p.byte_offset + 10)
    with pytest.raises(CorruptCheckpointError, match=(
            rf"pack '_packs/0' bytes \[{p.byte_offset}, {p.byte_offset + p.nbytes}\): "
            rf"expected {p.nbytes} bytes, found 10")):
        _read_all(storage, names)
    assert all(w.alloc.in_use == 0 for w in storage.windows)
