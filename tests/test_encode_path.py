"""One encode path: every method encodes outside a trainer, and what the demo and the report show
is what evaluation scored.

For each method a run folder is made from a tiny world (its stored config and the last stage's
checkpoint, random weights: no training needed to compare encodings). Evaluation's own embeddings
are the rows ``RetrievalEvaluation.update`` receives while ``ccr.experiments.evaluate`` runs the test
loop; the demo index (``ccr.demo.index.load_index``) and the report (``ccr.experiments.report``'s
re-encoding of a trained run) must give exactly those, and so must the method's
``encode_images`` / ``encode_texts`` called on a module that never met a trainer.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from rc3_helpers import TINY as RC3_TINY
from worlds import QUICK_BACKBONES

from ccr import metrics
from ccr.demo.index import load_index
from ccr.experiments.config import compose
from ccr.experiments.evaluate import evaluate, load_last_stage
from ccr.experiments.report.sources import encode_trained
from ccr.experiments.train import build_datamodule, stages_of

# 9 test images: a full batch, then one image alone, which evaluation fills up to 8 rows (a batch
# of one takes other CPU kernels: without the filling its embedding differs in the last bits)
EVAL_BATCH = 8
FULL_BATCH = 3  # divides the 9 images and their 36 captions: no batch to fill
WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=16",
    "data.synthetic.num_val=4",
    "data.synthetic.num_test=9",
    "data.synthetic.captions_per_image=2",
    "data.batch_size=4",
    f"data.eval_batch_size={EVAL_BATCH}",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de]",
    "trainer.cpu_threads=1",
]
# rc3 from a random-init tiny mBART (the world's would first have to be pretrained), its probe on
# its own passes: the case whose captions need their languages; ranked by the probe (the demo's).
METHODS = {
    "clip": [],
    "ccrk": [],
    "cl2cm": [],
    "mclip": [],
    "rc3": [
        *RC3_TINY,
        "evaluation.scorer=embeddings",
        "evaluation.max_images=null",
    ],
    "covlr": [],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


def untrained_run(method: str, world: Path, root: Path) -> Path:
    """A run folder of ``method`` (config.yaml, its last stage's checkpoint); returns the
    checkpoint."""
    cfg = compose(
        [f"method={method}", f"data.root={world}", f"run_dir={root}", *WORLD, *METHODS[method]]
    )
    run_dir = root / method
    (run_dir / "checkpoints").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    data = build_datamodule(cfg, roles=("test",))
    torch.manual_seed(0)
    module = stages_of(cfg, data)[-1].build(None)
    ckpt = run_dir / "checkpoints" / "done.ckpt"
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": {"method": {"name": method}}}, ckpt
    )
    return ckpt


def evaluation_embeddings(monkeypatch, ckpt: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """``side -> [n, D]``: the rows the test loop of ``ccr.experiments.evaluate`` scores, by index."""
    rows: dict[str, list] = {"images": [], "captions": []}
    real = metrics.RetrievalEvaluation.update

    def spy(self, side, index, emb, *args, **kwargs):
        rows[side].append((index.clone(), emb.detach().clone()))
        return real(self, side, index, emb, *args, **kwargs)

    monkeypatch.setattr(metrics.RetrievalEvaluation, "update", spy)
    evaluate(ckpt, list(overrides))
    monkeypatch.undo()
    out = {}
    for side, parts in rows.items():
        index = torch.cat([i for i, _ in parts])
        emb = torch.cat([e for _, e in parts])
        out[side] = emb[torch.argsort(index)]
        assert torch.equal(index.sort().values, torch.arange(len(index))), side
    return out


@pytest.fixture(scope="module", params=list(METHODS))
def run(request, world, tmp_path_factory):
    method = request.param
    return method, untrained_run(method, world, tmp_path_factory.mktemp(method))


@pytest.mark.slow
def test_the_demo_index_and_the_report_encode_exactly_what_evaluation_scored(run, monkeypatch):
    method, ckpt = run
    scored = evaluation_embeddings(monkeypatch, ckpt)
    index = load_index(ckpt)
    assert torch.equal(index.image_emb, scored["images"]), f"{method}: demo images"
    assert torch.equal(index.text_emb, scored["captions"]), f"{method}: demo captions"
    reported = encode_trained(ckpt.parents[1], {"checkpoint": str(ckpt)})
    assert torch.equal(reported.image_emb, scored["images"]), f"{method}: report images"
    assert torch.equal(reported.text_emb, scored["captions"]), f"{method}: report captions"


@pytest.mark.slow
def test_a_module_built_outside_lightning_encodes_as_its_validation_path(run, monkeypatch):
    """``encode_images`` / ``encode_texts`` on a module that was never given a trainer, on the
    batches evaluation encodes (every one full, so nothing is filled up), with what
    the batch carries besides images and captions as keyword inputs (RC3: each caption's
    language)."""
    method, ckpt = run
    restored = load_last_stage(ckpt)
    module, view = restored.module, restored.data.eval_view("test")
    with torch.no_grad():
        images = torch.cat(
            [module.encode_images(b["images"]) for b in view.image_loader(FULL_BATCH)]
        )
        texts = torch.cat(
            [
                module.encode_texts(
                    b["input_ids"],
                    b["attention_mask"],
                    **{k: b[k] for k in module.caption_inputs if k in b},
                )
                for b in view.caption_loader(FULL_BATCH)
            ]
        )
    assert module._trainer is None
    scored = evaluation_embeddings(monkeypatch, ckpt, f"data.eval_batch_size={FULL_BATCH}")
    assert torch.equal(images.float(), scored["images"]), method
    assert torch.equal(texts.float(), scored["captions"]), method
