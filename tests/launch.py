"""Training runs launched from tests as a user launches them: in a subprocess on a sharded world
(``on_shards``), and as torchrun launches one on two nodes (both on localhost, one CPU process
each, gloo, ``trainer=multinode``) beside the same run in one process with the global batch
(``single_and_two_nodes``), whose scores the multi-node tests compare."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["-m", "ccr.experiments.train"]
NODE = [
    "trainer=multinode",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.precision=32-true",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_shards(base: list[str], script_args: list[str], root: Path, run_id: str, *extra: str):
    """Run ``script_args`` (``-m ccr.experiments.train``, or a test script that interrupts it) with
    ``base`` on the shards under ``root/shards``; runs go to ``root/runs``. Killed after 300 s."""
    argv = [
        *base,
        f"data.root={root / 'shards'}",
        f"data.cache_dir={root / 'cache'}",
        f"run_dir={root / 'runs'}",
        f"run_id={run_id}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        ["timeout", "300", sys.executable, *script_args, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


def kill_and_resume_on_shards(base: list[str], root: Path, method: str, at_batch: int) -> dict:
    """Run ``cut`` killed after ``at_batch`` batches, then resumed with ``ckpt_path=last``; the
    resumed run's ``metrics.json``."""
    interrupted = [str(REPO / "tests" / "interrupted_train.py"), "KILL", str(at_batch)]
    killed = on_shards(base, interrupted, root, "cut")
    assert killed.returncode != 0
    resumed = on_shards(base, TRAIN, root, "cut", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return json.loads((root / "runs" / "shards" / method / "cut" / "metrics.json").read_text())


def single_and_two_nodes(argv: list[str], batch: int, runs: Path, logs: Path) -> tuple[dict, dict]:
    """``metrics.json`` of run ``single`` (one process, batches of ``2 * batch``) and of run
    ``nodes`` (two nodes, batches of ``batch`` each), both trained with ``argv`` and written under
    ``runs`` (``<run_dir>/<data>/<method>``); each node's output goes to ``logs/node<N>.log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    timeout = ["timeout", "300", sys.executable]
    single = subprocess.run(
        [*timeout, *TRAIN, *argv, "run_id=single", f"data.batch_size={2 * batch}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    port = free_port()
    launch = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    address = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    nodes = [
        subprocess.Popen(
            [
                *timeout,
                *launch,
                f"--node-rank={node}",
                *address,
                *TRAIN,
                *argv,
                "run_id=nodes",
                f"data.batch_size={batch}",
                *NODE,
            ],
            cwd=REPO,
            env=env,
            stdout=(logs / f"node{node}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for node in range(2)
    ]
    for number, node in enumerate(nodes):
        node.wait()
        assert node.returncode == 0, (logs / f"node{number}.log").read_text()[-3000:]
    one = json.loads((runs / "single" / "metrics.json").read_text())
    two = json.loads((runs / "nodes" / "metrics.json").read_text())
    assert two["config"]["trainer"]["num_nodes"] == 2
    return one, two
