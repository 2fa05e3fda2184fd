"""Log lines for hook services: text or one JSON object per line on stderr,
each line inside a call carrying the query's `trace_id`."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any, Optional

from lattice_hook._calls import TraceParent

logger = logging.getLogger("lattice_hook")

# The call being served, for the trace context of log lines written during it.
current_call: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("lattice_hook_call", default=None)


def current_trace() -> Optional[TraceParent]:
    """The trace context of the call being served, if any."""
    call = current_call.get()
    return call.trace if call is not None else None


def log(message: str, level: int = logging.INFO, **fields: Any) -> None:
    """Logs `message` with `fields` (sizes, counts, ids: never content) on
    the `lattice_hook` logger. Inside a call, the line carries the call's
    `trace_id` and `parent_span_id` when Lattice sent a trace context."""
    logger.log(level, message, extra={"lattice_fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, message, logger, the line's
    fields, and the current call's trace ids."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "message": record.getMessage(),
            "logger": record.name,
        }
        line.update(getattr(record, "lattice_fields", {}))
        trace = current_trace()
        if trace is not None:
            line["trace_id"] = trace.trace_id
            line["parent_span_id"] = trace.parent_span_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`TIME LEVEL message key=value …`, control characters escaped so that
    no value can start a line of its own."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "lattice_fields", {}))
        trace = current_trace()
        if trace is not None:
            fields["trace_id"] = trace.trace_id
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{stamp}.{int(record.msecs):03d}Z", record.levelname, _escape(record.getMessage())]
        parts += [f"{k}={_escape(str(v).lower() if isinstance(v, bool) else str(v))}" for k, v in fields.items()]
        if record.exc_info:
            parts.append("exception=" + _escape(self.formatException(record.exc_info)))
        return " ".join(parts)


def _escape(s: str) -> str:
    return s.encode("unicode_escape").decode("ascii") if any(ord(c) < 32 or ord(c) == 127 for c in s) else s


def init_logs(format: str = "text", level: int = logging.INFO) -> None:
    """Logs to stderr in `format` ("text" or "json") at `level` and above,
    through the root logger, so the hook's own `logging` calls are written
    the same way. Replaces handlers set by an earlier call."""
    if format not in ("text", "json"):
        raise ValueError(f"{format!r} is not a log format: text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    handler.set_name("lattice_hook")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "lattice_hook"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
