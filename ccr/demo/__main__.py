"""Start the retrieval demo over a checkpoint's evaluation split.

    python -m ccr.demo ckpt=runs/synthetic/ccrk/<run>/checkpoints/last.ckpt [split=test] [host=127.0.0.1]
        [port=7860] [k=10] [query=TEXT] [key=value ...]

``query`` is searched as soon as the page opens. Other ``key=value`` arguments are config
overrides, as for ``ccr.experiments.evaluate`` (e.g. ``data.root=...`` when the data moved).
Errors are one line, exit status 2 (``ccr.experiments.cli``).
"""

from __future__ import annotations

import errno
import importlib.util
import socket
from collections.abc import Sequence
from pathlib import Path

from ccr.demo.index import load_index
from ccr.experiments import cli
from ccr.experiments.config import ConfigError

USAGE = (
    "usage: python -m ccr.demo ckpt=PATH [split=val|test] [host=127.0.0.1] [port=7860] [k=10] [query=TEXT] "
    "[key=value ...]"
)
OPTIONS = {
    "ckpt": None,
    "split": "test",
    "host": "127.0.0.1",
    "port": "7860",
    "k": "10",
    "query": "",
}


def parse(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the demo's own options, the config overrides)."""
    options = dict(OPTIONS)
    overrides = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key in OPTIONS:
            options[key] = value
        else:
            overrides.append(arg)
    if not options["ckpt"]:
        raise ConfigError(USAGE)
    for key in ("port", "k"):
        if not options[key].isdigit():
            raise ConfigError(f"{key} must be a whole number, got '{options[key]}'")
    return options, overrides


def check_port_free(host: str, port: int) -> None:
    """The address the demo will serve on must be free now (a one-line error otherwise)."""
    with socket.socket() as probe:
        probe.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as servers bind: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"port {port} on {host} is in use (another demo or server?); "
                    "choose a free one with port=<number>"
                ) from None
            raise ConfigError(
                f"cannot serve on {host}:{port} ({err.strerror or err}); check host= and port="
            ) from None


def _main(args: list[str]) -> None:
    options, overrides = parse(args)
    ckpt = Path(options["ckpt"])
    if not ckpt.is_file():
        raise ConfigError(f"checkpoint {ckpt} does not exist")
    if importlib.util.find_spec("gradio") is None:
        raise ConfigError(
            "the demo needs the demo extra: pip install -e '.[demo]' (gradio is not installed)"
        )
    check_port_free(options["host"], int(options["port"]))  # before minutes of encoding
    index = load_index(ckpt, options["split"], overrides)
    from ccr.demo.app import (  # after the checkpoint checks: importing gradio is slow
        build_app,
        launch,
    )

    app = build_app(index, int(options["k"]), options["query"])
    print(
        f"demo: {len(index.image_ids)} images, {len(index.captions)} captions; "
        f"http://{options['host']}:{options['port']}",
        flush=True,
    )
    launch(app, index, options["host"], int(options["port"]))


def main(argv: Sequence[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
