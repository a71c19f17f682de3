"""``python tests/interrupted_train.py SIGNAL N key=value ...``: ``ccr.experiments.train`` that sends
itself ``SIGNAL`` (INT or KILL) when its N-th training batch (counted over all stages) starts, the
way a user's Ctrl-C or the OOM killer would stop it mid-run."""

import os
import signal
import sys

from lightning.pytorch.callbacks import Callback

import ccr.experiments.train as train_module


class SignalAtBatch(Callback):
    batches = 0

    def __init__(self, sig: int, at: int) -> None:
        self.sig, self.at = sig, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        SignalAtBatch.batches += 1
        if SignalAtBatch.batches == self.at:
            os.kill(os.getpid(), self.sig)


def main() -> None:
    sig, at, *overrides = sys.argv[1:]
    # A shell without job control starts background commands with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt: give the run the handler a terminal's Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    build = train_module.build_trainer

    def build_with_signal(*args, callbacks=(), **kwargs):
        extra = [SignalAtBatch(getattr(signal, f"SIG{sig}"), int(at))] if callbacks else []
        return build(*args, callbacks=[*callbacks, *extra], **kwargs)

    train_module.build_trainer = build_with_signal
    train_module.main(overrides)


if __name__ == "__main__":
    main()
