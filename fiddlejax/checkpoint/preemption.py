"""Preemption: SIGTERM (and Ctrl-C) become "save at the end of this step, then stop".

Kept apart from the checkpoint manager, which only asks :meth:`Preemption.reached` each step.
"""

from __future__ import annotations

import os
import signal
import threading

import jax


class Preemption:
    """Tells the training loop when to save and stop after a SIGTERM.

    One process: a SIGTERM handler sets a flag that the loop polls after each step. Several
    processes (``jax.distributed`` initialized): JAX's preemption sync manager already listens for
    SIGTERM and :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` makes every
    process agree on the same step, so no handler is installed; call :meth:`reached` every step.
    """

    def __init__(self):
        self._flag = threading.Event()
        self._previous = None
        self._installed = False
        self._last: tuple[int, bool] | None = None
        self._interrupts = 0

    @staticmethod
    def _distributed() -> bool:
        return jax.process_count() > 1

    def install(self) -> Preemption:
        """Handle SIGTERM and SIGINT (Ctrl-C) alike: save at the end of this step and stop.

        A second Ctrl-C interrupts at once. With several processes SIGINT is turned into the
        SIGTERM JAX's preemption manager listens for, so every process saves the same step.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = {}
        if not self._distributed():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        self._installed = True
        return self

    def _on_signal(self, sig, frame) -> None:
        if sig == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                signal.default_int_handler(sig, frame)  # second Ctrl-C: stop now
            if self._distributed():  # JAX's preemption manager agrees on the step to save
                os.kill(os.getpid(), signal.SIGTERM)
                return
        self._flag.set()

    def uninstall(self) -> None:
        if self._installed:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._installed = False

    def trigger(self) -> None:
        """Act as if SIGTERM arrived (tests, or a scheduler that warns some other way)."""
        self._flag.set()

    def reached(self, step: int) -> bool:
        """True at the step every process should save at and then stop (cached per step)."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        hit = self._flag.is_set()
        if self._distributed():
            from jax.experimental import multihost_utils

            try:
                hit = bool(multihost_utils.reached_preemption_sync_point(step)) or hit
            except RuntimeError:  # preemption service disabled: only our own flag counts
                pass
        self._last = (step, hit)
        return hit
