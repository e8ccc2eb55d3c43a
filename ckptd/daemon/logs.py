"""Logging of the daemon: text or one JSON object per line (``--log-format json``).

State changes of a checkpoint are logged with :func:`event` as one line each, with the
fields ``event``, ``state``, ``job``, ``step``, ``attempt``, ``rank`` and more.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger("ckptd.daemon")

_FIELDS = "ckptd_fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(getattr(record, _FIELDS, None) or {})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _FIELDS, None) or {}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if k != "event")
        line = (f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(record.created))} "
                f"{record.levelname.lower():7s} {record.getMessage()}")
        if extra:
            line += f" [{extra}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(fmt: str, verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("grpc").setLevel(logging.WARNING)


def event(msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured line (``fields`` become JSON keys)."""
    log.log(level, msg, extra={_FIELDS: fields})
