"""Pre-emption: SIGTERM/SIGINT become a request the loop honours between optimizer steps. No torch.

SLURM (``--signal=B:TERM@120``), Kubernetes and Ctrl-C all send a signal. The handler only records it; the
ranks agree on it at the next accumulation window (:func:`scale.train.windows`), finish the optimizer step
in flight, write a checkpoint and raise :class:`Preempted`; ``scale-train`` then exits with
:data:`EXIT_PREEMPTED`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): checkpoint written after SIGTERM/SIGINT; rerun to resume


class Preempted(Exception):
    """A signal arrived and a checkpoint of the last finished optimizer step was written."""


class Preemption:
    """Record the first SIGTERM/SIGINT; a second one takes the default action at once (Ctrl-C twice).

    Under ``accelerate launch``/``torchrun`` the launcher forwards SIGTERM to the ranks and kills them 30 s
    later (torch elastic's shutdown timeout).

    Attributes:
        signum: the signal received, or ``None``.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a signal arrived on this process."""
        return self.signum is not None

    def install(self) -> None:
        """Install the handlers (main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        # No logging here (not async-signal-safe); one line straight to stderr.
        os.write(2, f"scale: got signal {signum}: finishing this optimizer step, then checkpoint and exit "
                    f"{EXIT_PREEMPTED}\n".encode())
