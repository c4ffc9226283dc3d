"""Stop signals: SIGINT (Ctrl-C), and SIGTERM with --exit-signal-handler-for-training.

Without a handler, Ctrl-C gives a KeyboardInterrupt traceback on every rank and gloo's
"connection closed" errors on the ranks whose peer left first. Here the signal raises
``Interrupted``; the trainer turns it (and an error that a peer's stop caused) into one
line from rank 0 (``faults.stops_cleanly``), and a save it interrupts removes its
partial directory.
"""

import signal
import time


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C), or SIGTERM with --exit-signal-handler-for-training: stop at once."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, and SIGTERM with --exit-signal-handler-for-training, raise ``Interrupted``
    (unless --exit-signal-handler records that signal): every rank then stops with one
    line instead of a KeyboardInterrupt traceback and gloo's errors on each rank."""

    current = None  # the run's instance, for code that cannot be handed it (a save)

    def __init__(self, args):
        StopSignals.current = self
        taken = args.exit_signal if args.exit_signal_handler else None
        names = ["SIGINT"] + (["SIGTERM"] if args.exit_signal_handler_for_training else [])
        self.received = None
        self._previous = {}
        for name in names:
            if name != taken:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        first = self.received is None
        self.received = self.received or signum
        if first:  # a second Ctrl-C while stopping must not break the stop
            raise Interrupted(signum)

    def settle(self):
        """Let a signal that arrived during a blocking call reach its handler (a peer's
        exit may surface as a gloo error first); True if one did."""
        if self.received is None:
            try:
                time.sleep(0.3)
            except Interrupted:
                pass
        return self.received is not None

    def restore(self):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if StopSignals.current is self:
            StopSignals.current = None


def stop_signal_received():
    """The stop signal (SIGINT, ...) this process received, or None: an error raised
    while stopping on it (a peer gone from a collective) is its consequence."""
    current = StopSignals.current
    return current.received if current is not None and current.settle() else None
