"""Structured logging: one event per line on stderr, readable or JSON, with bound request ids.
Libraries' standard-library logs go through the same renderer."""
import dataclasses
import hashlib
import json
import logging
import os
import sys

import structlog

# Characters a logged value keeps of what a client sent (a constraint may be 64 KiB, a bias 1024 entries).
LOGGED_CHARS = 256
# Loggers of gRPC's Python layer; its C core obeys GRPC_VERBOSITY.
GRPC_LOGGERS = ("grpc", "grpc._cython", "grpc.aio")
# The last configure's level and format, for child processes that log the same way.
settings = {"level": "info", "fmt": "text"}


class _Stderr:
    """sys.stderr as it is when a line is written. Loggers are cached on first use, so one bound to
    the stream of configure time keeps writing there after sys.stderr is swapped (pytest does, per
    test, and closes the old one: every later log line then raised)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", service: str = "pagedserve", fmt: str = "text") -> None:
    """Configures structlog and the standard library's logging for this process; call once at start."""
    settings.update(level=level, fmt=fmt)
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0, pad_level=False,
                                                   exception_formatter=structlog.dev.plain_traceback))
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=renderer, foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # gRPC's own chatter (event loops, polling engines, channel states) was most of a debug log:
    # it shows only when asked for with gRPC's own variable, GRPC_VERBOSITY=debug (or info).
    if os.environ.get("GRPC_VERBOSITY", "").lower() not in ("debug", "info"):
        os.environ["GRPC_VERBOSITY"] = "ERROR"
        for name in GRPC_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def loggable(value: object, limit: int = LOGGED_CHARS) -> object:
    """`value` fit for one log line: a dataclass as the dict of its set fields, and a string, list or
    dict whose text passes `limit` characters cut there, with its length and a SHA-256 prefix (so
    that two requests' values can still be told apart)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: loggable(getattr(value, f.name), limit) for f in dataclasses.fields(value)
                if getattr(value, f.name) not in (None, False)}
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False, default=str)
    else:
        return value
    if len(text) <= limit:
        return value
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{text[:limit]}… ({len(text)} characters, sha256 {digest})"
