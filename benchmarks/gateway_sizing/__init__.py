"""Gateway sizing: how many spans per second one gateway Collector sustains,
and how much memory its tail sampler needs per 1,000 open traces.

``python -m benchmarks.gateway_sizing [--quick] [-o FILE]`` (from the
repository root). Not part of ``python -m benchmarks`` (B1-B5 measure
kvobs-otel's cost on vLLM; this measures the Collector that receives it).

What runs: ONE real gateway, the Go-built Collector (``KVOBS_OTELCOL_BIN``,
else .ci/otel-bins/build.sh) with the shipped ``deploy/otel-collector.yaml``;
only ports and ``KVOBS_TAIL_DECISION_WAIT`` come from the environment, as in
tests/stack.py. Its Jaeger and Tempo exporters point at an OTLP/gRPC sink in
this process that answers every export at once without decoding it, so the
stores never throttle the gateway; what reached them is counted by the
gateway's own ``otelcol_exporter_sent_spans``.

What is sent: recovery-episode traces recorded from kvobs-otel itself
(``kvobs-otel demo --mode harness`` writes OTLP JSON: vLLM's real scheduler
and connector, N rank processes), one trace per ``kv.recovery`` root with all
its spans, resources and attributes as exported. Each copy gets a fresh
trace id and fresh span ids (parent links kept), so the gateway sees
distinct traces of the recorded shapes and sizes. A recording is used rather
than spans built here because it is what the exporter really emits, from the
scheduler's and every rank's resource, with no second model of it to keep in
step. Requests are raw OTLP protobuf over gRPC with gzip, as an agent's
loadbalancing exporter sends them (its otlp protocol compresses with gzip by
default), about 1,024 spans per request (the agent outline's batch size).

Two phases:

- throughput: paced steps of rising spans/s (two ladders, each on a fresh
  gateway); a step is clean when the sender achieved the rate, the receiver
  refused nothing (memory_limiter), every trace was decided and every span
  delivered to the sink within decision_wait plus a margin, and nothing was
  evicted before its decision. Reported: the highest rate clean in every
  ladder on this machine, and the spans per CPU-second of the gateway
  process (its utime+stime over the step, less its idle rate). The
  shipped tail_sampling runs one event loop (num_shards 1) for ingest and
  decisions: a decision tick holds the receiver, so the limit shows as
  export latency and a missed rate well before the cores are busy;
- memory: a long decision_wait keeps every trace open; traces are sent in
  levels (e.g. 0, 10k, 30k, 60k) and the gateway's RSS (/proc, and its own
  otelcol_process_memory_rss) and Go heap are read at each level; a least
  squares line gives MiB per 1,000 open traces (at the recording's spans per
  trace) and the base. After the decisions, the RSS and heap are read again:
  v0.161.0 keeps a decided trace's entry (spans released) until num_traces
  newer ones push it out, unless a decision cache is configured.

Progress on stderr, a table and the scaled recommendation on stdout, all
figures in the JSON file. Exit status 0, 2 when it could not run (or bad
arguments).
"""
