"""Pre-emption: SIGTERM/SIGINT become a request the loop honours between optimizer steps. No torch.

SLURM (``--signal=B:TERM@120``), Kubernetes and Ctrl-C all send a signal. While the job starts up (process
group, data, model, the step-0 evaluation) a signal raises :class:`Preempted` at once: nothing was trained, so
nothing is evaluated or checkpointed, and a launcher waiting for its workers to stop (torch elastic gives them
30 s) is not kept waiting. Once training runs (:meth:`Preemption.defer`), the handler only records it; the
ranks agree on it at the next accumulation window (:func:`scale.train.windows`), finish the optimizer step
in flight, write a checkpoint and raise :class:`Preempted`. An evaluation in progress checks it between eval
batches and between generated samples, stops (:class:`EvalInterrupted`) and the checkpoint of the last finished
step follows within seconds, not after the whole evaluation. ``scale-train`` exits with :data:`EXIT_PREEMPTED`
either way.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): checkpoint written after SIGTERM/SIGINT; rerun to resume


class Preempted(Exception):
    """A signal arrived and a checkpoint of the last finished optimizer step was written."""


class EvalInterrupted(Exception):
    """An evaluation (or its generation) stopped between two batches because a stop was requested; every rank
    raises it at the same batch. The loop then checkpoints the last finished optimizer step."""


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
        self.immediate = True  # start-up: a signal raises Preempted at once (see defer)
        self._previous: dict[int, Any] = {}

    def defer(self) -> None:
        """Training starts: from now on a signal is honoured at the next optimizer-step boundary.

        Raises:
            Preempted: a signal arrived before (it was recorded while the handler could not raise).
        """
        self.immediate = False
        if self.signum is not None:
            raise Preempted(f"got signal {self.signum} before training started: nothing trained, no checkpoint "
                            f"written")

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
        # No logging here (its lock may be held by the code interrupted); one line straight to stderr.
        if self.immediate:
            os.write(2, f"scale: got signal {signum} while starting up: stopping now, exit {EXIT_PREEMPTED}\n".encode())
            raise Preempted(f"got signal {signum} while starting up: nothing trained, no checkpoint written")
        os.write(2, f"scale: got signal {signum}: finishing this optimizer step, then checkpoint and exit "
                    f"{EXIT_PREEMPTED}\n".encode())


def exit_on_signal_while_importing() -> None:
    """Until :meth:`Preemption.install` takes over, SIGTERM/SIGINT end the process at once with
    :data:`EXIT_PREEMPTED`: call it first thing in an entry point, before the imports (torch, transformers,
    DeepSpeed: seconds) that precede everything else. Nothing has been written yet, so ``os._exit`` loses
    nothing, and a launcher stopping its workers (torch elastic waits 30 s for them) is not kept waiting.
    Main thread only; a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: Any) -> None:
        os.write(2, f"scale: got signal {signum} while starting up: exit {EXIT_PREEMPTED}\n".encode())
        os._exit(EXIT_PREEMPTED)

    for s in Preemption.SIGNALS:
        signal.signal(s, handle)
