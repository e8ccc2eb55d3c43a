"""Extra state (step, RNG states, LR scheduler, GradScaler, user dicts) as JSON + tensors.

:func:`encode` turns a nested value into JSON, moving every tensor (and numpy array) out
into a list so it can be stored as a tensor; :func:`decode` reverses it.  Nothing is
pickled.  Supported: None, bool, int, float (incl. nan/inf), str, list, tuple, dict (any
keys of those scalar types), dense torch.Tensor, numpy arrays and scalars (a numpy
scalar comes back as the Python bool/int/float/str of the same value).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ckptd.errors import ConfigError

_MARKERS = ("__tensor__", "__ndarray__", "__tuple__", "__items__")
_PLAIN = frozenset((int, float, str, bool, type(None)))


def _encode_seq(seq: list | tuple, tensors: list[torch.Tensor], path: str,
                active: set[int]) -> list:
    if all(type(v) in _PLAIN for v in seq):  # e.g. Python's RNG state: 625 ints, every save
        return list(seq)
    return [_encode(v, tensors, f"{path}[{i}]", active) for i, v in enumerate(seq)]


def encode(obj: Any, tensors: list[torch.Tensor], path: str = "extra") -> Any:
    """``obj`` as a JSON document whose tensors (and numpy arrays) are appended to
    ``tensors`` and referenced by index; a value it cannot store is a ConfigError."""
    try:
        return _encode(obj, tensors, path, set())
    except RecursionError:
        raise ConfigError(
            f"{path} is nested too deeply to store (Python's recursion limit was reached): "
            "flatten the structure before saving"
        ) from None


def _encode(obj: Any, tensors: list[torch.Tensor], path: str, active: set[int]) -> Any:
    """``active``: the ids of the containers ``obj`` is inside (a cycle is an error)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None  # type: ignore[assignment]
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, torch.Tensor):
        _check_tensor(obj, path)
        tensors.append(obj.detach())
        return {"__tensor__": len(tensors) - 1}
    if np is not None and isinstance(obj, np.ndarray):
        try:
            t = torch.from_numpy(np.ascontiguousarray(obj)).clone()
        except (TypeError, ValueError) as exc:  # object, str, datetime, big-endian arrays
            raise ConfigError(
                f"extra state value at {path} is a numpy array of dtype {obj.dtype.str!r}, "
                f"which ckptd cannot store ({exc}); expected a native-byte-order bool, int, "
                "uint, float or complex array. Convert it (e.g. `arr.astype(arr.dtype."
                "newbyteorder('='))` or `arr.tolist()`) before saving."
            ) from None
        tensors.append(t)
        return {"__ndarray__": len(tensors) - 1}
    if np is not None and isinstance(obj, np.generic):
        value = obj.item()  # comes back as the Python int/float/bool/str of the same value
        if type(value) not in _PLAIN:
            raise ConfigError(
                f"extra state value at {path} is a numpy {type(obj).__name__} scalar, which "
                "ckptd cannot store as JSON; expected a numpy bool, int, float or str scalar. "
                "Wrap it in an array (`np.asarray(x)`, stored as a 0-d array) or convert it "
                "before saving."
            )
        return value
    if not isinstance(obj, (tuple, list, dict)):
        raise ConfigError(
            f"extra state value at {path} is a {type(obj).__name__}, which ckptd cannot store "
            "without pickle; expected JSON values, tuples, dicts, tensors or numpy arrays. "
            "Convert it (e.g. call its state_dict()) before saving."
        )
    if id(obj) in active:
        raise ConfigError(
            f"extra state value at {path} is a {type(obj).__name__} that contains itself (a "
            "cycle); expected a tree of JSON values, tuples, dicts and tensors. Remove the "
            "cycle before saving."
        )
    active.add(id(obj))
    try:
        if isinstance(obj, tuple):
            return {"__tuple__": _encode_seq(obj, tensors, path, active)}
        if isinstance(obj, list):
            return _encode_seq(obj, tensors, path, active)
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: _encode(v, tensors, f"{path}.{k}", active) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if k is not None and not isinstance(k, (bool, int, float, str, tuple)):
                raise ConfigError(
                    f"extra state key at {path} is a {type(k).__name__}; keys must be str, int, "
                    "float, bool or tuples of those"
                )
            items.append([_encode(k, tensors, path, active),
                          _encode(v, tensors, f"{path}[{k!r}]", active)])
        return {"__items__": items}
    finally:
        active.discard(id(obj))


def _check_tensor(t: torch.Tensor, path: str) -> None:
    """ConfigError naming ``path`` for a tensor ckptd cannot store (checked here so the
    message names the extra value, not the internal name ``_extra/<rank>/<i>``)."""
    from ckptd.format.dtypes import SUPPORTED, dtype_name

    why = None
    if t.layout != torch.strided or t.is_nested:
        why = (f"a {'nested' if t.is_nested else str(t.layout)} tensor; ckptd stores dense "
               "(strided) tensors. Convert it (e.g. `t.to_dense()`) before saving")
    elif t.is_meta:
        why = ("a tensor on the meta device (without data); ckptd saves real values only. "
               "Materialize it before saving")
    else:
        try:
            dtype_name(t.dtype)
        except TypeError:
            why = (f"a tensor of dtype {t.dtype}; ckptd stores {', '.join(SUPPORTED)}. Convert it "
                   "(e.g. dequantize a quantized tensor) before saving")
    if why is not None:
        raise ConfigError(f"extra state value at {path} is {why}.")


def decode(doc: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(doc, list):
        return [decode(v, tensor) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "__tensor__" in doc and len(doc) == 1:
        return tensor(int(doc["__tensor__"]))
    if "__ndarray__" in doc and len(doc) == 1:
        return tensor(int(doc["__ndarray__"])).numpy()
    if "__tuple__" in doc and len(doc) == 1:
        return tuple(decode(v, tensor) for v in doc["__tuple__"])
    if "__items__" in doc and len(doc) == 1:
        out = {}
        for k, v in doc["__items__"]:
            key = decode(k, tensor)
            out[tuple(key) if isinstance(key, list) else key] = decode(v, tensor)
        return out
    return {k: decode(v, tensor) for k, v in doc.items()}


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), numpy, python."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        v = state["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s[0], np.asarray(s[1], dtype=np.uint32), int(s[2]), int(s[3]),
                             float(s[4])))
