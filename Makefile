# The course's commands. A fresh Linux machine with Python 3.11+ needs only `make book` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
NB ?=

.PHONY: help install book test lab grade exercises stamp clean

help:
	@echo "make book       build the website into _build/html"
	@echo "make test       everything CI checks"
	@echo "make lab        JupyterLab on the course"
	@echo "make grade NB=exercises/01_vector_add.ipynb   grade your notebook(s)"
	@echo "make exercises  regenerate exercises/ from solutions/ (maintainers)"
	@echo "make stamp      execute and stamp every lesson on this machine's GPU, refreshing recorded results"

# .venv is created once and reinstalled whenever requirements.txt or pyproject.toml change.
$(INSTALLED): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "the course needs Python 3.11 or newer"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing requirements.txt into $(VENV) (a few minutes the first time)..."
	@$(BIN)/python -m pip install -q -r requirements.txt 2> $(VENV)/pip.log || { cat $(VENV)/pip.log; exit 1; }
	@touch $@

install: $(INSTALLED)

book: $(INSTALLED)
	$(BIN)/python tools/landing_figure.py
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo ""
	@echo "The website is built. Open: file://$(CURDIR)/_build/html/index.html"

test: $(INSTALLED)
	$(BIN)/python tools/notebooks.py --check
	$(BIN)/python tools/exercises.py --check
	$(BIN)/python tools/stamp.py --check notebooks/*.ipynb
	$(BIN)/python -m pytest tests notebooks solutions --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=600 -q
	$(BIN)/python tools/landing_figure.py
	$(BIN)/jupyter-book build . -W -n --keep-going -q
	$(BIN)/python tools/check_site.py

lab: $(INSTALLED)
	$(BIN)/jupyter lab

grade: $(INSTALLED)
	@test -n "$(NB)" || { echo "usage: make grade NB=exercises/01_vector_add.ipynb"; exit 2; }
	$(BIN)/python -m kernelcourse.grade $(NB)

exercises: $(INSTALLED)
	$(BIN)/python tools/notebooks.py
	$(BIN)/python tools/exercises.py

stamp: $(INSTALLED)
	$(BIN)/python tools/stamp.py --record notebooks/*.ipynb

clean:
	rm -rf _build
