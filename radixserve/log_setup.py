"""Logging as llama-server's flags set it up (`serve`, `cluster` and each cluster replica)."""

from __future__ import annotations

import json
import logging

from radixserve.config import ServerConfig


def _log_level(verbosity: int) -> int:
    """llama.cpp's thresholds: 0 output, 1 errors, 2 warnings, 3 info, 4 trace, 5 debug."""
    return [logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG,
            logging.DEBUG][max(0, min(verbosity, 5))]


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"time": record.created, "level": record.levelname.lower(),
                           "logger": record.name, "msg": record.getMessage()})


def setup_logging(cfg: ServerConfig) -> None:
    """--log-disable, --log-file, --log-jsonl, --log-prefix, --log-timestamps, -lv."""
    fmt = ("%(asctime)s " if cfg.log_timestamps else "") + (
        "%(levelname)s %(name)s: " if cfg.log_prefix else "") + "%(message)s"
    handlers: list[logging.Handler] = []
    if not cfg.log_disable:
        handlers.append(logging.StreamHandler())
    if cfg.log_file:
        handlers.append(logging.FileHandler(cfg.log_file, encoding="utf-8"))
    formatter = JsonLines() if cfg.log_jsonl else logging.Formatter(fmt)
    for h in handlers:
        h.setFormatter(formatter)
    logging.basicConfig(level=_log_level(cfg.log_verbosity), handlers=handlers or
                        [logging.NullHandler()], force=True)
