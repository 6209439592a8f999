"""Lifecycle state machines: compact serving-path events in, finished
records (jobs, transfers, episodes) out. They run on the pipeline's drain
thread, never on vLLM's serving thread."""
