"""Peak memory of one training step with and without ``optim.grad_cache_chunks``, per method.

    python benchmarks/bench_grad_cache.py --rows 256 --chunks 8

Each (method case, chunks) runs in a fresh process on the tiny random-init modules of
``tests/test_grad_cache_methods.py`` (and clip / ccrk from ``tests/test_grad_cache.py``), scaled to
``--rows`` rows. After a warm-up step (so gradients and optimiser-free buffers exist), the process
resets its peak resident set (``/proc/self/clear_refs``) and runs one forward and backward; the
reported ``step_peak_mib`` is that peak less the resident set before the step: the step's
activations and temporaries. glibc is told to serve every allocation of 64 KiB or more by mmap
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set and the peak is the step's
own. CPU only, Linux only; one JSON line per run, then a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def resident_kib(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cases() -> dict:
    """name -> (build(chunks), batch(), loss(module, batch)) for every method that chunks."""
    import test_grad_cache as dual
    import test_grad_cache_methods as methods

    table = {name: (c.build, c.batch, c.loss) for name, c in methods.CASES.items()}
    for name in ("clip", "ccrk"):
        table[name] = (
            lambda chunks, name=name: dual.build(name, chunks),
            lambda: dual.training_batch(rows=methods.ROWS),
            methods.step,
        )
    return table


def one_run(name: str, rows: int, chunks: int) -> dict:
    """The step's peak memory and seconds for one case (run in its own process)."""
    import test_grad_cache_methods as methods
    import torch

    torch.set_num_threads(1)
    methods.ROWS = rows
    build, batch_of, loss_of = cases()[name]
    module, batch = build(chunks), batch_of()
    module.train()

    def step() -> None:
        module.zero_grad(set_to_none=False)
        torch.manual_seed(1)
        loss_of(module, batch).backward()

    step()  # warm-up: gradients allocated, allocator settled
    before = resident_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak = resident_kib("VmHWM")
    return {
        "case": name,
        "rows": rows,
        "chunks": chunks,
        "step_peak_mib": round((peak - before) / 1024, 1),
        "step_s": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument(
        "--one", nargs=3, metavar=("CASE", "ROWS", "CHUNKS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        name, rows, chunks = args.one
        print(json.dumps(one_run(name, int(rows), int(chunks))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    results = []
    for name in args.cases or list(cases()):
        for chunks in (1, args.chunks):
            done = subprocess.run(
                [sys.executable, __file__, "--one", name, str(args.rows), str(chunks)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"{name} chunks={chunks} failed:\n{done.stderr[-2000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{'case':32} {'peak MiB, 1 chunk':>18} {f'{args.chunks} chunks':>10} {'ratio':>6}")
    for whole, chunked in zip(results[::2], results[1::2], strict=True):
        ratio = chunked["step_peak_mib"] / max(whole["step_peak_mib"], 1e-9)
        print(
            f"{whole['case']:32} {whole['step_peak_mib']:18.1f} "
            f"{chunked['step_peak_mib']:10.1f} {ratio:6.2f}"
        )


if __name__ == "__main__":
    main()
