# Every target builds the environment it needs first (.venv, pinned torch, the suite itself).
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
LEADERBOARD = $(PY) -m experiments.leaderboard --runs $(RUNS) $(if $(OUT),--out $(OUT))

.PHONY: setup train eval leaderboard compare test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

.PHONY: pretrain
pretrain: $(STAMP)  # the default world and its pretrained backbones (cached; a run also builds them)
	$(PY) -m datamodules.synthetic.backbones $(ARGS)

train: $(STAMP)
	$(PY) -m experiments.train method=$(METHOD) data=$(DATA) trainer=$(TRAINER) $(ARGS)

eval: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make eval CKPT=runs/.../checkpoints/last.ckpt [ARGS=...]"; exit 2; }
	$(PY) -m experiments.evaluate ckpt=$(CKPT) $(ARGS)

# Writes $(RUNS)/leaderboard.{md,csv,png}; OUT=<folder> writes there instead (OUT=. for the committed one).
leaderboard: $(STAMP)
	$(LEADERBOARD)

compare: $(STAMP)
	$(PY) -m experiments.compare --seeds $(SEEDS) --data $(DATA) $(ARGS)
	$(LEADERBOARD)

test: $(STAMP)
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	$(PY) benchmarks/bench_metrics.py
	$(PY) benchmarks/bench_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
