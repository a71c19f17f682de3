"""Time ``make pretrain`` from nothing: the default world, its tokenizer and its backbones built
into a fresh folder, against issue 13's limit of 5 minutes on 2 CPU cores.

    python benchmarks/bench_pretrain.py [overrides, e.g. data.backbones.text.dropout=0.1]

Prints the whole command's wall time, the build's own split (text, image, from the cache's
``backbones.json``) and the ratio to the limit. Run it on an idle machine: it is a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_S = 300.0
REPO = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ccr.experiments.pretrain",
                f"data.root={root}",
                *overrides,
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - started
        (summary,) = Path(root).glob("backbones-*/backbones.json")
        built = json.loads(summary.read_text())
    text, total = built["text_seconds"], built["total_seconds"]
    print(
        f"make pretrain from nothing: {wall:.1f} s (limit {LIMIT_S:.0f} s, ratio {wall / LIMIT_S:.2f})"
    )
    print(
        f"  backbone build {total:.1f} s: text {text:.1f} s, image {total - text:.1f} s; "
        f"world, tokenizer and start-up {wall - total:.1f} s"
    )
    print(
        f"  text MLM loss {built['text_mlm_loss']}, translation preference "
        f"{built.get('translation_preference')}, image label F1 {built['image_label_f1']}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
