# The two commands README.md promises: `make demo` and `make test`.
.PHONY: setup demo test test-quick bench schema

.venv/.setup-complete: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: .venv/.setup-complete

demo: setup
	.venv/bin/tensorizer-manifest demo

# Every test, the slow end-to-end ones on real vLLM included (what CI runs).
test: setup
	.venv/bin/python -m pytest -q

# The fast subset, for work in progress.
test-quick: setup
	.venv/bin/python -m pytest -q -m "not e2e"

schema: setup
	.venv/bin/tensorizer-manifest schema > schemas/manifest-v1.schema.json

# Figures, not assertions: validation and hashing cost against the load itself.
bench: setup
	.venv/bin/python benchmarks/bench_validate.py
