"""``python tests/falling_val_train.py [INT|KILL N] key=value ...``: ``ccr.experiments.train`` (sent
``SIGNAL`` at its N-th batch as ``interrupted_train.py`` does, when given one) whose val ``en/mR``
is forced to ``100 - global step``: its first validation is the best, so model selection must keep
the earliest validated weights, in one process or across a resume."""

import sys
from contextlib import contextmanager
from unittest import mock

from ccr.methods.base import RetrievalModule


@contextmanager
def falling_val_scores():
    """Within: every val report's ``en/mR`` is ``100 - global step``; test reports are real."""
    report = RetrievalModule._report

    def report_falling(self, split: str) -> None:
        if split == "val":  # torchmetrics binds compute per instance: replace it on this one
            step, compute = self.trainer.global_step, self.evaluation.compute
            self.evaluation.compute = lambda: {**compute(), "en/mR": 100.0 - step}
        report(self, split)

    with mock.patch.object(RetrievalModule, "_report", report_falling):
        yield


def main() -> None:
    args = sys.argv[1:]
    with falling_val_scores():
        if args and args[0] in ("INT", "KILL"):
            import interrupted_train

            sys.argv = [sys.argv[0], *args]
            interrupted_train.main()
        else:
            import ccr.experiments.train

            ccr.experiments.train.main(args)


if __name__ == "__main__":
    main()
