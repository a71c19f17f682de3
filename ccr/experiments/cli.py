"""What every command-line entry point shares: the suite's own errors as one line, and quiet
logs.

A problem the user can fix (a config key, a data record, a checkpoint, a diverged run, a full
disk or a read-only folder) prints ``error: ...`` on one line and exits with status 2; ``--traceback`` (or ``CCR_TRACEBACK=1``)
shows the full traceback instead. Warnings a user can do nothing about are silenced.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from ccr.experiments.trainer import TrainingDiverged

TRACEBACK_FLAG = "--traceback"
USER_ERRORS = (ValueError, FileNotFoundError, TrainingDiverged)  # ConfigError is a ValueError
# A file the suite cannot write (or read) for a reason outside the code: the file and what to do.
STORAGE_ADVICE = {
    errno.ENOSPC: "free space, or write the run elsewhere (run_dir=<folder>)",
    errno.EDQUOT: "free space, or write the run elsewhere (run_dir=<folder>)",
    errno.EROFS: "write the run elsewhere (run_dir=<folder>)",
    errno.EACCES: "check its permissions (runs are written under run_dir=<folder>)",
    errno.EPERM: "check its permissions (runs are written under run_dir=<folder>)",
}

# Lightning / torch messages that are advice to library authors or tips, not about the run.
QUIET_WARNINGS = (
    r".*LeafSpec.*",  # torch pytree deprecation inside Lightning
    r".*weights_only.*",  # torch.load notice (the suite loads weights only)
    r".*sync_dist=True.*",  # per-key advice at every DDP evaluation
    # a mid-epoch resume: the suite re-positions its training loaders itself (train.StageData),
    # so Lightning's "not resumable ... unreliable results" would be false; resume is tested exact
    r".*dataloader is not resumable.*",
)
QUIET_LOG_LINES = ("litlogger",)  # Lightning's logging-service tip


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in QUIET_LOG_LINES)


def quiet() -> None:
    """Silence the warnings and log lines listed above (idempotent)."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines())


def one_line(err: BaseException) -> str:
    """The error's message on one line (a DataLoader worker's wrapped error: its last line)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if "Traceback" in str(err):
        return lines[-1]
    return " ".join(lines)


def run(main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> None:
    """Call ``main(args)``; a user error becomes ``error: ...`` and exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    show_traceback = TRACEBACK_FLAG in args or os.environ.get("CCR_TRACEBACK") == "1"
    args = [a for a in args if a != TRACEBACK_FLAG]
    quiet()
    try:
        main(args)
    except USER_ERRORS as err:
        if show_traceback:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as err:
        if show_traceback or err.errno not in STORAGE_ADVICE:
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror}; {STORAGE_ADVICE[err.errno]}", file=sys.stderr)
        raise SystemExit(2) from None
