# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both build (once) the cached CPU vLLM environment via .ci/setup-env.sh.
SHELL := /bin/bash

.PHONY: demo test lint env
env:
	@bash .ci/setup-env.sh
demo:
	@venv=$$(bash .ci/setup-env.sh) && $$venv/bin/kvobs-otel demo $(ARGS)
test:
	@venv=$$(bash .ci/setup-env.sh) && eval "$$(bash .ci/setup-servers.sh)" && \
	  $$venv/bin/python -m pytest -q $(ARGS)
lint:
	@venv=$$(bash .ci/setup-env.sh) && $$venv/bin/ruff check kvobs_otel tests
# Benchmarks (docs/benchmarks.md): `make bench`, `make bench ARGS="--quick"`,
# `make bench ARGS="--only B2"`. Results on stdout and in benchmarks-results.json.
.PHONY: bench
bench:
	@venv=$$(bash .ci/setup-env.sh) && $$venv/bin/python -m benchmarks $(ARGS)
