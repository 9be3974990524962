"""Deferring Ctrl-C over a stretch of host code that must run to its end: the engine's steps
(``decoding.engine``) and the command lines' writes of checkpoints and caches (``models.train``,
``models.medusa_train``: never half a file).

The engine donates its page pool to every jitted call and keeps the result: a
``KeyboardInterrupt`` raised between a call's return and the assignment of its outputs (Python
runs signal handlers at the next bytecode boundary after the call) would drop the only live
pool, and one raised inside the scheduler's bookkeeping would leave pages or requests half
moved. :class:`deferred_interrupts` holds SIGINT for the duration of a ``with`` block and
delivers it (to the handler that was installed, so ``KeyboardInterrupt`` by default) when the
block ends, with the state consistent again.

Only the main thread receives Python signal handlers, so elsewhere (an engine thread behind a
server) the block runs unchanged; so does one where SIGINT is ignored or left to the OS.
"""

from __future__ import annotations

import signal
import threading


class deferred_interrupts:  # noqa: N801 (a context manager, read as a phrase)
    """``with deferred_interrupts(): ...``: SIGINT during the block is delivered at its end."""

    def __enter__(self):
        self._old, self._caught = None, []
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                self._old = old
                signal.signal(signal.SIGINT, lambda signum, frame: self._caught.append(frame))
        return self

    def __exit__(self, *exc):
        if self._old is None:
            return False
        # signal.signal runs handlers of signals already pending first: they land in _caught.
        signal.signal(signal.SIGINT, self._old)
        if self._caught:
            self._old(signal.SIGINT, self._caught[0])
        return False
