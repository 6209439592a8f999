"""Host adapter for the vLLM-HUST fork's observer contracts.

The fork publishes typed KV transfer observations through its own observer
registries (contract ``vllm.kv-transfer.observer.v2``, correlated across
processes, and the older per-process ``.v1``). Where they exist we register
with them instead of patching the connector, so nothing is observed twice.

- ``contracts``  find the contract modules and admit only known versions
- ``records``    validate one host record (never raises; a reason on refusal)
- ``lifecycle``  host records -> the lifecycle records every host produces
- ``adapter``    the live observers registered with the fork (serving path)
- ``plugin_records``  validate one line of the fork plugin's JSONL files
- ``jsonl``      read those files into per-process streams (``kvobs-otel import-hust``)
"""
