# Every target builds the environment it needs first (.venv, the suite itself, every package at the
# exact version of requirements/constraints.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
METHOD ?= clip
DATA   ?= synthetic
TRAINER ?= cpu
SEEDS  ?= 0 1 2
ARGS   ?=
RUNS   ?= runs
OUT    ?=
EXTRAS ?= dev,demo
CONSTRAINTS = requirements/constraints.txt
LEADERBOARD = $(PY) -m ccr.experiments.leaderboard --runs $(RUNS) $(if $(OUT),--out $(OUT))

.PHONY: setup train eval eval-zoo report leaderboard compare demo test test-all lint format typecheck bench bench-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) torch torchvision
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $(STAMP)

.PHONY: pretrain
pretrain: $(STAMP)  # the default world and its pretrained backbones (cached; a run also builds them)
	$(PY) -m ccr.experiments.pretrain $(ARGS)

train: $(STAMP)
	$(PY) -m ccr.experiments.train method=$(METHOD) data=$(DATA) trainer=$(TRAINER) $(ARGS)

# CKPT=<checkpoint>: re-evaluate a trained run. MODEL=zoo:<name>, MODEL=open_clip:<arch>
# PRETRAINED=<tag> or MODEL=hf:<name or path>: score a pretrained model zero-shot on DATA (an external
# leaderboard row); REVISION=<commit> pins a hub model (ARGS="remote_code=true" runs its own code).
eval: $(STAMP)
	@test -n "$(CKPT)$(MODEL)" || { echo "usage: make eval CKPT=runs/.../checkpoints/last.ckpt | MODEL=zoo:<name> | MODEL=open_clip:<arch> PRETRAINED=<tag> | MODEL=hf:<name> [REVISION=<commit>] [DATA=...] [ARGS=...]"; exit 2; }
	$(if $(MODEL),$(PY) -m ccr.experiments.external model=$(MODEL) $(if $(PRETRAINED),pretrained=$(PRETRAINED)) $(if $(REVISION),revision=$(REVISION)) data=$(DATA) $(ARGS),$(PY) -m ccr.experiments.evaluate ckpt=$(CKPT) $(ARGS))

# Scores every model of ccr/experiments/configs/zoo/ whose weights are already in the local cache on DATA
# (one row each) and lists the others with the reason they were skipped; it fetches no weights.
eval-zoo: $(STAMP)
	$(PY) -m ccr.experiments.eval_zoo data=$(DATA) $(ARGS)

# RUN=<run folder>[,<run folder>]: the consistency report (HTML + per-instance ranks CSV).
report: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make report RUN=runs/<data>/<method>/<run>[,<other run>] [ARGS=...]"; exit 2; }
	$(PY) -m ccr.experiments.report --run $(RUN) $(ARGS)

# Writes $(RUNS)/leaderboard.{md,csv,png}; OUT=<folder> writes there instead (OUT=. for the committed one).
leaderboard: $(STAMP)
	$(LEADERBOARD)

compare: $(STAMP)
	$(PY) -m ccr.experiments.compare --seeds $(SEEDS) --data $(DATA) $(ARGS)
	$(LEADERBOARD)

# Serves the checkpoint's test images on http://127.0.0.1:7860 (ARGS: port=, host=, split=val, k=, query=).
demo: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make demo CKPT=runs/.../checkpoints/last.ckpt [ARGS=...]"; exit 2; }
	$(PY) -m ccr.demo ckpt=$(CKPT) $(ARGS)

# The fast tests; test-all (what CI runs) adds the slow end-to-end ones (@pytest.mark.slow).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2

# The gate every change passes (CI runs it before the tests): ruff's rules and its formatter.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_metrics.py
	$(PY) benchmarks/bench_throughput.py

# Paper-size training throughput on one GPU: bare loop / Lightning / real loader, FLOPs, MFU
# (docs/benchmarks.md). ARGS: --methods clip,ccrk --steps 30 data.num_workers=12 ...; --tiny on a CPU.
bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
