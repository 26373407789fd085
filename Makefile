# kiln's main job on a bundled example, from a fresh clone:
#   make demo      install (.venv with torch), export a model with `kiln export`, run it with
#                  `kiln run` in a fresh process, check it against torch eager, print both latencies
# Pick another example: make demo DEMO_MODEL=examples/models.py:MLP DEMO_SHAPE=1x64

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= build/demo
DEMO_MODEL ?= examples/models.py:SmallCNN
DEMO_SHAPE ?= 1x3x32x32
DEMO_REPEAT ?= 200

.PHONY: help demo demo-install test lint clean docs

help:  ## list the targets
	@echo "make demo    install (.venv with torch), export a bundled model with kiln export, run it with kiln run,"
	@echo "             check it against torch eager (DEMO_MODEL=file.py:Class DEMO_SHAPE=1x3x32x32)"
	@echo "make test    install the test dependencies into .venv and run the test suite (the README's command)"
	@echo "make lint    pyflakes' checks (flake8 --select=F) over the package and its tests"
	@echo "make clean   remove build outputs, caches and the demo's files (not .venv)"
	@echo "make docs    build the user guide (docs/guide/, mkdocs --strict) into build/site/ (installs .venv-docs)"

# The README's test command (and CI's, through .ci/run).
test:
	$(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q -e '.[dev]' torch==2.13.0 && $(BIN)/python -m pytest

# bench/ is left out: its GPU scripts read names they delete afterwards, which pyflakes cannot follow.
lint:
	@test -x $(BIN)/flake8 || $(BIN)/pip install -q flake8
	$(BIN)/flake8 --select=F $$(git ls-files '*.py' | grep -v '^bench/')

# The user guide (docs/guide/*.md, mkdocs.yml) into build/site/, as CI builds it (--strict), in a venv of its
# own: mkdocs and its plugins bring their own Markdown stack. The site opens from disk: build/site/index.html.
DOCS_VENV ?= .venv-docs
docs:
	@$(DOCS_VENV)/bin/python -c "import kiln, mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null \
		|| ($(PYTHON) -m venv $(DOCS_VENV) && $(DOCS_VENV)/bin/pip install -q -e '.[docs]')
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict
	@echo "the guide is in build/site/: open build/site/index.html"

clean:
	rm -rf build/ dist/ .pytest_cache .hypothesis
	find . -name __pycache__ -type d -not -path './.venv*' -prune -exec rm -rf {} +

# Installs only what is missing: a .venv that already imports this kiln and torch 2.13 is kept.
demo-install:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import kiln, torch; assert torch.__version__.startswith('2.13')" 2>/dev/null \
		|| $(BIN)/pip install -q -e '.[torch]' torch==2.13.0

demo: demo-install
	@mkdir -p $(DEMO_DIR)
	$(BIN)/python examples/demo_check.py prepare --shape $(DEMO_SHAPE) -o $(DEMO_DIR)/x.npy
	$(BIN)/kiln export $(DEMO_MODEL) -o $(DEMO_DIR)/model.kiln --input x:$(DEMO_SHAPE) --dynamic-batch
	$(BIN)/kiln run $(DEMO_DIR)/model.kiln --input x=$(DEMO_DIR)/x.npy -o $(DEMO_DIR)/out.npz \
		--repeat $(DEMO_REPEAT) > $(DEMO_DIR)/run.txt
	@cat $(DEMO_DIR)/run.txt
	$(BIN)/python examples/demo_check.py check --model $(DEMO_MODEL) --input $(DEMO_DIR)/x.npy \
		--output $(DEMO_DIR)/out.npz --kiln-log $(DEMO_DIR)/run.txt
