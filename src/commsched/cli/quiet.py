"""Lightning's console, without repeats and advertising: for processes that build many Trainers
(the benchmark, the demo, the tests' workers) and for every commsched run.

Each message of Lightning's rank-zero logger is shown once per process (the accelerator banner
comes with every Trainer), and the logging-service tip not at all. Warnings that are untrue for
how commsched uses Lightning are dropped by their exact text.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings

_RANK_ZERO = "lightning.pytorch.utilities.rank_zero"
_NEVER = (
    "💡 Tip: For seamless cloud logging",
    "\nDetected KeyboardInterrupt, attempting graceful shutdown",  # commsched says what the interrupt did
)
_UNTRUE_WARNINGS = (
    # commsched-train's run directory holds its config before the logger writes there; nothing is deleted
    ".*Previous log files in this directory will be deleted.*",
    ".*does not have many workers.*",  # synthetic data in memory needs no loader workers
    ".*LeafSpec.*",  # a deprecation inside a dependency's use of torch's pytree; nothing for a user to do
)


class _OncePerProcess(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_NEVER) or message in self._seen:
            return False
        self._seen.add(message)
        return True


def quiet_lightning() -> None:
    logger = logging.getLogger(_RANK_ZERO)
    if not any(isinstance(f, _OncePerProcess) for f in logger.filters):
        logger.addFilter(_OncePerProcess())
    for pattern in _UNTRUE_WARNINGS:
        warnings.filterwarnings("ignore", pattern)


def exit_silently_on_interrupt() -> None:
    """For worker processes of a command: Ctrl-C reaches them with the command, which says the one
    line; a worker ends at once (exit 130) instead of printing a traceback of wherever it was."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
