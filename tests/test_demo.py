"""The retrieval demo shows the ranks the metrics count.

A tiny clip run is trained for a few steps; its demo index must reproduce the run's metrics.json,
its search order and caption ranks must equal a dense brute-force ranking (ties by the expected
rank of ``ccr.metrics.ties``), and the Gradio app must serve exactly those numbers to a client and
render in headless Chromium. The app tests need the ``demo`` extra (``make test`` installs it).
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from browser import render, requires_chromium
from worlds import QUICK_BACKBONES

from ccr.demo.__main__ import main as demo_main
from ccr.demo.index import RetrievalIndex, language_rank_blocks, load_index
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.train import train
from ccr.metrics import functional, retrieval_report

TINY_WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=32",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=12",
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de,ja]",
]
CLIENT_TIMEOUT_S = 60
MISSING_EXTRA = "the demo extra is not installed (pip install -e '.[demo]')"
START_TIMEOUT_S = 120  # python -m ccr.demo: imports, encoding the split, starting the server
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(metrics.json of a 3-step clip run, its checkpoint)."""
    root = tmp_path_factory.mktemp("demo")
    run_dir = train(
        compose(
            [
                "method=clip",
                f"data.root={root / 'world'}",
                f"run_dir={root / 'runs'}",
                "run_id=tiny",
                "trainer.max_steps=3",
                "trainer.log_every_n_steps=1",
                "trainer.progress_refresh_rate=0",
                *TINY_WORLD,
            ]
        )
    )
    result = json.loads((run_dir / "metrics.json").read_text())
    return result, Path(result["checkpoint"])


@pytest.fixture(scope="module")
def index(run):
    return load_index(run[1])


def brute_rank(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Expected 1-based rank of the best positive in one dense score row, ties broken at random."""
    best = scores[positive].max()
    higher, tied = int((scores > best).sum()), int((scores == best).sum())
    tied_positives = int((scores[positive] == best).sum())
    return higher + (tied - tied_positives) / (tied_positives + 1) + 1


def captions_of(index: RetrievalIndex, language: str) -> torch.Tensor:
    return torch.tensor([i for i, lang in enumerate(index.caption_language) if lang == language])


# ---- the index against the run's metrics ---------------------------------------------------------


@pytest.mark.slow
def test_index_embeddings_reproduce_the_runs_metrics(run, index):
    metrics = run[0]["metrics"]
    report = retrieval_report(
        index.image_emb,
        index.text_emb,
        index.caption_image,
        index.caption_language,
        index.image_ids,
    )
    assert {key: metrics[key] for key in report} == report


@pytest.mark.slow
def test_index_rank_blocks_are_the_ranks_behind_the_recalls(run, index):
    metrics = run[0]["metrics"]
    for lang in ("en", "de", "ja"):
        i2t = index.i2t_blocks[lang]
        for k in (1, 5, 10):
            assert (
                functional.recall_at_k(index.t2i_blocks[captions_of(index, lang)], k)
                == metrics[f"{lang}/t2i/R@{k}"]
            )
            assert functional.recall_at_k(i2t[i2t[:, 0] >= 0], k) == metrics[f"{lang}/i2t/R@{k}"]


# ---- search and translations against a dense brute force ----------------------------------------


@pytest.mark.slow
def test_search_ranks_every_image_as_a_dense_ranking_does(index):
    count = len(index.image_ids)
    for caption in range(0, len(index.captions), 7):
        text = index.captions[caption]
        scores = index.image_scores(index.encode_queries([text])[0])
        hits = index.search(text, count)
        assert sorted(hit.image for hit in hits) == list(range(count))
        for hit in hits:
            assert hit.rank == brute_rank(scores, torch.tensor([hit.image]))
            assert hit.score == float(scores[hit.image])
        assert [hit.rank for hit in hits] == sorted(hit.rank for hit in hits)


@pytest.mark.slow
def test_a_typed_dataset_caption_finds_its_image_at_its_metric_rank(index):
    for caption in range(len(index.captions)):
        hits = index.search(index.captions[caption], len(index.image_ids))
        own = next(hit for hit in hits if hit.image == int(index.caption_image[caption]))
        metric_rank = index.translations(caption)
        assert own.rank == next(row.image_rank for row in metric_rank if row.caption == caption)


@pytest.mark.slow
def test_top_k_is_the_head_of_the_full_ranking(index):
    text = index.captions[3]
    full = index.search(text, len(index.image_ids))
    assert index.search(text, 4) == full[:4]


@pytest.mark.slow
def test_translations_are_every_caption_of_the_image_with_dense_ranks(index):
    caption = 61
    image = int(index.caption_image[caption])
    rows = index.translations(caption)
    assert (
        sorted(row.caption for row in rows)
        == (index.caption_image == image).nonzero().squeeze(1).tolist()
    )
    assert [row.language for row in rows] == sorted(
        (row.language for row in rows), key=index.languages.index
    )
    for row in rows:
        assert row.text == index.captions[row.caption]
        assert row.image_rank == brute_rank(
            index.image_emb @ index.text_emb[row.caption], torch.tensor([image])
        )
        same_language = captions_of(index, row.language)
        owners = index.caption_image[same_language]
        scores = index.text_emb[same_language] @ index.image_emb[image]
        assert row.caption_rank == brute_rank(scores, (owners == image).nonzero().squeeze(1))


def constant_index(num_images: int = 5) -> RetrievalIndex:
    """An index whose model maps every image to one embedding: every image ties with every other."""
    image_emb = torch.nn.functional.normalize(torch.ones(num_images, 4), dim=1)
    text_emb = torch.nn.functional.normalize(
        torch.randn(2 * num_images, 4, generator=torch.Generator().manual_seed(0)), dim=1
    )
    caption_image = torch.arange(num_images).repeat(2)
    languages = ["en"] * num_images + ["de"] * num_images
    t2i, i2t = language_rank_blocks(
        image_emb, text_emb, caption_image, languages, ["en", "de"], chunk_size=2, ndcg_k=3
    )
    return RetrievalIndex(
        checkpoint=Path("constant.ckpt"),
        split="test",
        scorer_note=None,
        image_ids=[f"img{i}" for i in range(num_images)],
        image_paths=[Path(f"img{i}.png") for i in range(num_images)],
        captions=[f"caption {i}" for i in range(2 * num_images)],
        caption_image=caption_image,
        caption_language=languages,
        languages=["en", "de"],
        image_emb=image_emb,
        text_emb=text_emb,
        t2i_blocks=t2i,
        i2t_blocks=i2t,
        encode_queries=lambda texts: text_emb[: len(texts)],
        chunk_size=2,
    )


def test_a_constant_model_ties_every_image_at_the_mean_place():
    index = constant_index(5)
    hits = index.search("anything", 5)
    assert [hit.rank for hit in hits] == [3.0] * 5  # places 1..5 shared: mean 3
    assert [hit.image for hit in hits] == [0, 1, 2, 3, 4]  # ties listed in index order
    report = retrieval_report(
        index.image_emb,
        index.text_emb,
        index.caption_image,
        index.caption_language,
        index.image_ids,
    )
    for row in index.translations(2):
        assert row.image_rank == 3.0 == report[f"{row.language}/t2i/MeanR"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda index: index.search("   ", 3), "type a query"),
        (lambda index: index.search("x", 0), "k must be between 1 and 5"),
        (lambda index: index.search("x", 6), "k must be between 1 and 5"),
        (lambda index: index.translations(10), "caption 10 out of range"),
    ],
)
def test_bad_requests_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(constant_index(5))


# ---- loading and the command line ---------------------------------------------------------------


def test_a_file_that_is_no_checkpoint_is_named(tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_text("not a checkpoint")
    with pytest.raises(ConfigError, match=f"{bad} is not a suite checkpoint"):
        load_index(bad)


@pytest.mark.slow
def test_a_split_other_than_val_or_test_is_refused(run):
    with pytest.raises(ConfigError, match="split must be one of val|test, got 'train'"):
        load_index(run[1], split="train")


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "usage: python -m ccr.demo ckpt=PATH"),
        (["ckpt=missing.ckpt"], "checkpoint missing.ckpt does not exist"),
        (["ckpt=x.ckpt", "port=http"], "port must be a whole number, got 'http'"),
    ],
)
def test_cli_errors_are_one_line_with_status_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo_main(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and "\n" not in error


def test_a_port_in_use_is_refused_before_the_checkpoint_is_read_or_encoded(tmp_path, capsys):
    pytest.importorskip("gradio", reason=MISSING_EXTRA)
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_text("not a checkpoint: reading it would fail with another message")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            demo_main([f"ckpt={ckpt}", f"port={port}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: port {port} on 127.0.0.1 is in use (another demo or server?); choose a free one "
        "with port=<number>"
    )


def test_without_the_demo_extra_the_command_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import ccr.demo.__main__ as command

    real_find_spec = command.importlib.util.find_spec
    monkeypatch.setattr(
        command.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "gradio" else real_find_spec(name, *rest),
    )
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"")
    with pytest.raises(SystemExit):
        command.main([f"ckpt={ckpt}"])
    assert "the demo needs the demo extra: pip install -e '.[demo]'" in capsys.readouterr().err


# ---- the Gradio app ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def served(index):
    """(URL of the app over ``index`` on 127.0.0.1, the index); the server is closed afterwards."""
    pytest.importorskip("gradio", reason=MISSING_EXTRA)
    from ccr.demo.app import build_app, launch

    app = build_app(index, k=3, query=index.captions[0])
    port = free_port()
    url = launch(app, index, "127.0.0.1", port, block=False)
    try:
        yield url, index
    finally:
        app.close()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "the demo server is still listening"


@pytest.mark.slow
def test_gradio_client_gets_the_index_numbers(served, tmp_path):
    client_module = pytest.importorskip("gradio_client", reason=MISSING_EXTRA)
    url, index = served
    assert url.startswith("http://127.0.0.1:")
    client = client_module.Client(
        url, verbose=False, download_files=str(tmp_path), httpx_kwargs={"timeout": CLIENT_TIMEOUT_S}
    )

    text = index.captions[5]
    gallery, table = client.predict(text, 4, api_name="/search")
    hits = index.search(text, 4)
    assert table["headers"] == ["rank", "image", "score"]
    assert table["data"] == [[hit.rank, hit.image_id, hit.score] for hit in hits]
    assert [item["caption"] for item in gallery] == [
        f"#{hit.rank:g} {hit.image_id} ({hit.score:.4f})" for hit in hits
    ]
    assert [Path(item["image"]).read_bytes() for item in gallery] == [
        hit.path.read_bytes() for hit in hits
    ]

    image, ranks = client.predict(62, api_name="/caption_ranks")
    assert Path(image).read_bytes() == index.image_paths[int(index.caption_image[62])].read_bytes()
    assert ranks["data"] == [
        [row.language, row.text, row.image_rank, row.caption_rank] for row in index.translations(62)
    ]

    with pytest.raises(Exception, match="type a query"):
        client.predict("  ", 4, api_name="/search")
    with pytest.raises(Exception, match=f"caption {len(index.captions)} out of range"):
        client.predict(len(index.captions), api_name="/caption_ranks")


@pytest.mark.slow
@requires_chromium
def test_the_page_renders_in_headless_chromium_without_console_errors(served, tmp_path):
    url, _ = served
    shot = tmp_path / "demo.png"
    assert render(url, shot) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def wait_until_served(url: str, process: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"python -m ccr.demo exited with {process.returncode}: {process.stderr.read()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"python -m ccr.demo did not serve {url} within {START_TIMEOUT_S} s")


@pytest.mark.slow
def test_the_command_serves_the_checkpoint_on_localhost(run, index, tmp_path):
    """``make demo CKPT=...`` runs ``python -m ccr.demo ckpt=...``: it serves the same ranks."""
    client_module = pytest.importorskip("gradio_client", reason=MISSING_EXTRA)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ccr.demo", f"ckpt={run[1]}", f"port={port}", "k=3"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_served(url, process, time.monotonic() + START_TIMEOUT_S)
        client = client_module.Client(
            url,
            verbose=False,
            download_files=str(tmp_path),
            httpx_kwargs={"timeout": CLIENT_TIMEOUT_S},
        )
        _, table = client.predict(index.captions[1], 5, api_name="/search")
        assert table["data"] == [
            [hit.rank, hit.image_id, hit.score] for hit in index.search(index.captions[1], 5)
        ]
    finally:
        process.terminate()
        process.wait(timeout=30)
