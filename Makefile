# The course's commands. A fresh Linux machine with Python 3.11+ needs only `make book` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
NB ?=
# What .venv installs: requirements.txt, unless test-latest asks for the newest releases instead.
PIP_INSTALL ?= -r requirements.txt
# The libraries whose releases change the course's results; test-latest takes the newest of each.
NEWEST := torch triton numpy numba numba-cuda
LATEST_VENV := .venv-latest
# The oldest torch and triton the course supports (kernelcourse/world.py's OLDEST says the same);
# test-oldest checks the course on them.
OLDEST_PINS := torch==2.8.0 triton==3.4.0
OLDEST_VENV := .venv-oldest
# gpu-check uses the interpreter it is given (make gpu-check PYTHON=python3), else .venv's when there is
# one, else python3. It never builds .venv: a GPU machine's own Python, offline, is enough.
GPU_PYTHON := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(or $(wildcard $(BIN)/python),$(PYTHON)))

.PHONY: help install book test test-seeds test-latest test-oldest gpu-check lab mywork grade exercises stamp clean

help:
	@echo "make book       build the website into _build/html"
	@echo "make test       everything CI checks"
	@echo "make test-seeds    the grader tests on other drawn cases (SEEDS=\"1 2 3\", else five random seeds)"
	@echo "make test-latest   make test on the newest releases of $(NEWEST), in $(LATEST_VENV)"
	@echo "make test-oldest   make test on the oldest releases the course supports ($(OLDEST_PINS)), in $(OLDEST_VENV)"
	@echo "make gpu-check  on a CUDA GPU: unit tests, every notebook, every grade; one summary table"
	@echo "make lab        JupyterLab on the course"
	@echo "make mywork     copy the exercises into mywork/, your own folder (never overwritten)"
	@echo "make grade      grade every notebook in mywork/ (or: make grade NB=mywork/01_vector_add.ipynb)"
	@echo "make exercises  regenerate exercises/ from solutions/ (maintainers; never overwrites anyone's answers)"
	@echo "make stamp      execute and stamp every lesson on this machine's GPU, refreshing recorded results"

# .venv is created once and reinstalled whenever requirements.txt or pyproject.toml change.
$(INSTALLED): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "the course needs Python 3.11 or newer"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing the course's requirements into $(VENV) (a few minutes the first time)..."
	@$(BIN)/python -m pip install -q $(PIP_INSTALL) 2> $(VENV)/pip.log || { cat $(VENV)/pip.log; exit 1; }
	@touch $@

install: $(INSTALLED)

# The build's log goes to _build/book.log and is shown only when something went wrong.
BUILD_SITE = mkdir -p _build && $(BIN)/python tools/landing_figure.py > _build/book.log && \
	$(BIN)/jupyter-book build . -W -n --keep-going -q >> _build/book.log 2>&1 || \
	{ cat _build/book.log; echo "The website did not build: the messages above say why."; exit 1; }

book: $(INSTALLED)
	@$(BUILD_SITE)
	@echo "The website is built. Open: file://$(CURDIR)/_build/html/index.html"

test: $(INSTALLED)
	$(BIN)/python tools/notebooks.py --check
	$(BIN)/python tools/exercises.py --check
	$(BIN)/python tools/stamp.py --check notebooks/*.ipynb
	$(BIN)/python -m pytest tests notebooks solutions --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=600 -q
	@$(BUILD_SITE)
	$(BIN)/python tools/check_site.py

# The grader tests on SEEDS="1 2 3" (five random seeds when not given; `make test` uses one fixed seed), to
# find a check or a hint that holds for some drawn cases and not for others. The failing seed is printed.
test-seeds: $(INSTALLED)
	@for s in $(or $(SEEDS),$$($(BIN)/python -c 'import random; print(*random.sample(range(1, 10**6), 5))')); do \
		echo "KC_GRADE_SEED=$$s"; \
		KC_GRADE_SEED=$$s $(BIN)/python -m pytest -q -x tests/test_grading_ch0*.py tests/test_speed_exercises.py \
			|| { echo "failed with KC_GRADE_SEED=$$s"; exit 1; }; \
	done

# The second CI job: the same checks on the newest release of each library in NEWEST (requirements.txt's
# other lines as they are), in a virtual environment of its own. CI passes the CPU index of PyTorch.
test-latest:
	rm -f $(LATEST_VENV)/.installed  # upgrade to whatever is newest today
	$(MAKE) install VENV=$(LATEST_VENV) PIP_INSTALL='--upgrade --upgrade-strategy eager $(NEWEST) -r <(grep -vE "^(torch|triton|numpy)\b" requirements.txt)'
	@$(LATEST_VENV)/bin/python -c 'from kernelcourse.world import versions; print("newest releases:", versions())'
	$(MAKE) test VENV=$(LATEST_VENV)

# The third CI job: the same checks on the oldest torch and triton the course supports (requirements.txt's
# other lines as they are), in a virtual environment of its own. CI passes the CPU index of PyTorch.
test-oldest:
	rm -f $(OLDEST_VENV)/.installed
	$(MAKE) install VENV=$(OLDEST_VENV) PIP_INSTALL='$(OLDEST_PINS) -r <(grep -vE "^(torch|triton)\b" requirements.txt)'
	@$(OLDEST_VENV)/bin/python -c 'from kernelcourse.world import versions; print("oldest releases:", versions())'
	$(MAKE) test VENV=$(OLDEST_VENV)

# CHAPTERS="01 02" checks those chapters only (their notebooks and tests, and the tests of no chapter);
# PARTS="tests grades" runs only those parts (tests, lessons, solutions, grades); PREHOPPER=1 checks, on a
# Hopper GPU, the paths of GPUs before Hopper (tools/gpu_check.py --pre-hopper); T4=1 the course's choices
# for a T4 (--as-t4). STAMP=1 stamps the lessons whose stamp is stale as it checks them (--stamp; RESTAMP="08"
# stamps lesson 08 too); GPUS=1 keeps a machine of several GPUs to one (by default the work is shared out).
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(addprefix --chapter ,$(CHAPTERS)) $(addprefix --only ,$(PARTS)) \
		$(if $(PREHOPPER),--pre-hopper) $(if $(T4),--as-t4) $(if $(STAMP),--stamp) $(addprefix --restamp ,$(RESTAMP)) \
		$(if $(GPUS),--gpus $(GPUS))

lab: $(INSTALLED)
	$(BIN)/jupyter lab

# Learners work in mywork/ (git ignores it); nothing here ever writes over a notebook in it.
mywork: $(INSTALLED)
	@$(BIN)/python tools/exercises.py --mywork

grade: $(INSTALLED)
	@nbs="$(NB)"; test -n "$$nbs" || nbs="$$(ls mywork/[0-9][0-9]_*.ipynb 2>/dev/null)"; \
	test -n "$$nbs" || { echo "Nothing to grade in mywork/: run 'make mywork', solve the exercises there, then 'make grade' (or: make grade NB=path/to/notebook.ipynb)."; exit 2; }; \
	$(BIN)/python -m kernelcourse.grade $$nbs

exercises: $(INSTALLED)
	$(BIN)/python tools/notebooks.py
	$(BIN)/python tools/exercises.py

stamp: $(INSTALLED)
	$(BIN)/python tools/stamp.py --record notebooks/*.ipynb

clean:
	rm -rf _build
