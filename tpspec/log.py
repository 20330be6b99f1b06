"""The package's loggers: ``logging.getLogger("tpspec.<module>")``, level from
``TPSPEC_LOG_LEVEL`` (default ``INFO``; e.g. ``WARNING`` silences start-up summaries).

The ``tpspec`` logger gets one stderr handler of its own the first time a module asks for
a logger, unless the application configured the ``tpspec`` logger already. :func:`plural`
spells counts in messages ("1 rank", "2 ranks").
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "TPSPEC_LOG_LEVEL"
_configured = False


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``"1 rank"``, ``"2 ranks"``: ``count`` and ``noun``, plural (``nouns``, default ``noun + "s"``)
    unless ``count`` is 1."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` under the configured ``tpspec`` logger."""
    global _configured
    if not _configured:
        _configured = True
        root = logging.getLogger("tpspec")
        if not root.handlers:
            level = os.environ.get(LEVEL_ENV, "INFO").upper()
            root.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
            root.propagate = False
    return logging.getLogger(name)
