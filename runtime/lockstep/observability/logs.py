"""Logging of a runtime process: one line format, chatty libraries quietened.

Why it exists: every entry point (`lockstep run`, the driver pod, a trainer rank) logs the same way,
and none of them should import another's module for it.

Who calls it: lockstep.cli (run, driver, trainer).
"""

from __future__ import annotations

import logging


def configure_logging() -> None:
    """INFO to stderr with time, level and logger; httpx, aiohttp.access, matplotlib, transformers at WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "aiohttp.access", "matplotlib", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
