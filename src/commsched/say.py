"""What commsched tells the user while training: once, from rank 0, without configuring logging.

Messages go to the ``commsched`` logger at INFO. As Lightning does for its own logger, that logger
prints to stderr by itself only while the application has configured no logging (no root handler);
once it has, messages propagate to the application's handlers instead, so no line appears twice.
Ranks other than 0 say nothing: every rank reaches the same decisions. `size_text` spells a size
the same way in every line (the closing summary, a schedule's own lines).
"""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("commsched")
_OWN_HANDLER = "commsched-console"


def _console() -> None:
    root_configured = logging.getLogger().hasHandlers() and not any(h.get_name() == _OWN_HANDLER for h in log.handlers)
    if root_configured:
        log.propagate = True
        for handler in [h for h in log.handlers if h.get_name() == _OWN_HANDLER]:
            log.removeHandler(handler)
    elif not any(h.get_name() == _OWN_HANDLER for h in log.handlers):
        handler = logging.StreamHandler()
        handler.set_name(_OWN_HANDLER)
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


@rank_zero_only
def say(message: str) -> None:
    """One line for the user, from rank 0 only."""
    _console()
    log.info(message)


def size_text(nbytes: float) -> str:
    """'4.9 KB', '13.6 MB': the unit that keeps one decimal meaningful."""
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 0.1 * 2**20 else f"{nbytes / 2**10:.1f} KB"


def say_from_this_rank(message: str) -> None:
    """One line from whichever rank says it: after a failure, ranks no longer agree on what they hold."""
    _console()
    log.warning(message)
