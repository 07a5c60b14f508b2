# The two commands README.md promises: `make demo` and `make test`.
.PHONY: setup demo test test-quick test-e2e-quick lint format bench schema release-check

SOURCES = tensorizer_manifest tests scripts benchmarks

.venv/.setup-complete: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: .venv/.setup-complete

demo: setup
	.venv/bin/tensorizer-manifest demo

# Two pytest-xdist workers, one per core: each engine start is mostly one busy thread (tests/conftest.py
# keeps a module's tests, and each kind of the family matrix, on one worker).
PYTEST = .venv/bin/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=12

# Lint, format check and the import layers, then every test, the slow end-to-end ones on real vLLM
# included (what CI runs).
test: lint
	$(PYTEST)

# The fast subset, for work in progress.
test-quick: lint
	$(PYTEST) -m "not e2e"

# A few kinds of the architecture matrix on real vLLM (one dense, one MoE, one long-context kind).
test-e2e-quick: lint
	$(PYTEST) -m "quick"

lint: setup
	.venv/bin/ruff check $(SOURCES)
	.venv/bin/ruff format --check $(SOURCES)
	.venv/bin/lint-imports
	.venv/bin/mypy

format: setup
	.venv/bin/ruff check --fix $(SOURCES)
	.venv/bin/ruff format $(SOURCES)

schema: setup
	.venv/bin/tensorizer-manifest schema > schemas/manifest-v2.schema.json  # manifest-v1.schema.json stays as published
	.venv/bin/python -c "import msgspec, sys; from tensorizer_manifest.format.generation import json_schema; \
		sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2) + b'\n')" \
		> schemas/manifest-v3.schema.json  # the pointer and the generation (format version 3)

# Figures, not assertions (docs/performance.md): load time of every path as a fresh process, manifest
# scaling, validation and hashing, GPTQ and MoE. Takes 30-40 minutes on 2 cores; run it on a quiet machine.
bench: setup
	.venv/bin/python -m pip install -q "matplotlib>=3.7"
	.venv/bin/python benchmarks/bench_load.py
	.venv/bin/python benchmarks/bench_kernels.py
	.venv/bin/python benchmarks/bench_manifest.py --json-out docs/benchmarks/manifest.json
	.venv/bin/python benchmarks/bench_validate.py
	.venv/bin/python benchmarks/bench_base.py
	.venv/bin/python benchmarks/bench_compile.py

# vLLM names this package uses, checked against a release's wheel (read, not run): make release-check VLLM=0.34.0
VLLM ?= 0.34.0
release-check: setup
	.venv/bin/python scripts/vllm_release_check.py $(VLLM)
