"""The privacy boundary, scanned: no raw address, tensor content, token id,
block id or block hash in any attribute of any span, event, link, resource or
metric the real-vLLM CPU harness produces (every id list is checked against
the job ids and ranks recorded from vLLM as it ran); request ids replaced by
a keyed hash when configured; bad keys refused at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from oracle import assert_traces_match_vllm

import kvobs_otel
from kvobs_otel.config import ConfigError, Settings, load_settings
from kvobs_otel.pipeline import current_pipeline
from kvobs_otel.telemetry.otlp_json import spans_to_otlp_json
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.harness.engine import Harness, HarnessConfig
from kvobs_otel.tools.harness.fabricate import random_tokens
from kvobs_otel.tools.otlp_file import spans_from_document

from test_vllm_episodes import start_recovery

pytestmark = pytest.mark.vllm

# Every attribute key the product may export (spans, events, links, resources,
# metric points). A new key must be added here on purpose, after asking
# whether it could carry anything private.
ALLOWED_KEYS = {
    "kvobs.request.id", "kvobs.recovery.epoch", "kvobs.outcome", "kvobs.scheduler.generation",
    "kvobs.worker.generation", "kvobs.rank", "kvobs.job.id", "kvobs.job.kind", "kvobs.job.sync",
    "kvobs.job.flushed", "kvobs.job.role", "kvobs.blocks", "kvobs.bytes", "kvobs.direction",
    "kvobs.device.duration_s", "kvobs.expedited", "kvobs.receipt.expected_ranks",
    "kvobs.receipt.ranks", "kvobs.receipt.missing_ranks", "kvobs.receipt.duplicates",
    "kvobs.preserve.job_ids", "kvobs.restore.job_ids", "kvobs.admission.roster",
    "kvobs.compute.kind", "kvobs.first_compute.ranks", "kvobs.first_compute.missing_ranks",
    "kvobs.incomplete.job_ids", "kvobs.jobs", "kvobs.requeue.reason", "kvobs.link",
    "kvobs.join.scope", "error.type", "kvobs.job.ids",
    # Receipts and failures (vLLM 0.34): ranks, job ids, chunk counts, seconds.
    "kvobs.receipt.failed_ranks", "kvobs.receipt.last_ranks", "kvobs.receipt.spread_s",
    "kvobs.host_tier.chunks", "kvobs.host_tier.dropped_chunks",
    "kvobs.restore.failed_job_ids", "kvobs.restore.failed_ranks",
    # Recovery accounting: token COUNTS (never token ids).
    "kvobs.tokens.discarded", "kvobs.tokens.restored", "kvobs.tokens.resident",
    "kvobs.tokens.recomputed", "kvobs.tokens.other_connector",
    # resource
    "service.name", "service.version", "service.instance.id", "host.name", "process.pid",
    "kvobs.role", "kvobs.engine.id", "kvobs.tp.rank", "kvobs.pp.rank", "kvobs.dp.rank",
    "kvobs.device.type", "kvobs.vllm.version", "kvobs.host.adapter", "kvobs.export",
    "telemetry.sdk.language", "telemetry.sdk.name", "telemetry.sdk.version",
    # metric point dimensions
    "direction", "outcome", "rank", "kind", "clock", "compute_kind", "reason", "stage",
    "signal", "source",
}


def _values(attrs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for k, v in attrs.items():
        if isinstance(v, (list, tuple)):
            for x in v:
                yield k, x
        else:
            yield k, v


def everything(telemetry) -> tuple[list[tuple[str, Any]], list[tuple[str, list]]]:
    """(key, scalar value) of every attribute exported, and every list value."""
    scalars: list[tuple[str, Any]] = []
    lists: list[tuple[str, list]] = []
    for s in telemetry.spans():
        groups = [dict(s.attributes), dict(s.resource.attributes)]
        groups += [dict(e.attributes) for e in s.events]
        groups += [dict(link.attributes) for link in s.links]
        for g in groups:
            scalars.extend(_values(g))
            lists.extend((k, list(v)) for k, v in g.items() if isinstance(v, (list, tuple)))
        scalars.append(("<span name>", s.name))
    for reader in telemetry.readers:
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            scalars.extend(_values(dict(rm.resource.attributes)))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        scalars.extend(_values(dict(p.attributes)))
                        for ex in getattr(p, "exemplars", ()) or ():
                            scalars.extend(_values(dict(ex.filtered_attributes or {})))
    return scalars, lists


# Ground truth recorded as vLLM runs: every block id list it allocated, and
# every job id its connector handed to the copy engine.
BLOCK_LISTS: list[tuple[int, ...]] = []
JOB_IDS: set[int] = set()
HARNESS: list = []  # the last run's harness: vLLM's own record of what it did
ID_LISTS = {  # list attributes: job ids or ranks, each checked against ground truth
    "jobs": {"kvobs.preserve.job_ids", "kvobs.restore.job_ids", "kvobs.incomplete.job_ids",
             "kvobs.job.ids",
             "kvobs.restore.failed_job_ids", "kvobs.admission.roster"},
    "ranks": {"kvobs.receipt.ranks", "kvobs.receipt.missing_ranks", "kvobs.receipt.last_ranks",
              "kvobs.receipt.failed_ranks", "kvobs.first_compute.ranks",
              "kvobs.first_compute.missing_ranks", "kvobs.restore.failed_ranks"},
}


def run_recovery(telemetry, prompts: dict[str, list[int]]) -> tuple[set[int], set[bytes]]:
    """Recovery + ordinary traffic on 2 inline ranks; returns the cache
    tensors' addresses and every block hash vLLM computed (and records the
    block ids and job ids, above)."""
    from kvobs_otel.tools.harness import cpu_backend

    hashes: set[bytes] = set()
    BLOCK_LISTS.clear()
    JOB_IDS.clear()
    submit = cpu_backend.HarnessCPUOffloadingWorker._submit

    def spy(self, job_id, *args, **kwargs):
        JOB_IDS.add(job_id)
        return submit(self, job_id, *args, **kwargs)

    cpu_backend.HarnessCPUOffloadingWorker._submit = spy
    try:
        return _run_recovery(prompts, hashes)
    finally:
        cpu_backend.HarnessCPUOffloadingWorker._submit = submit


def _run_recovery(prompts: dict[str, list[int]], hashes: set[bytes]
                  ) -> tuple[set[int], set[bytes]]:
    with Harness(HarnessConfig(num_ranks=2)) as h:
        HARNESS[:] = [h]
        pointers = {t.data_ptr() for r in range(2) for t in h.runner(r).kv_caches.values()}
        pointers |= {t.untyped_storage().data_ptr() for r in range(2)
                     for t in h.runner(r).kv_caches.values()}
        start_recovery(h, "secret-req-a", prompt_len=prompts["secret-req-a"],
                       trace_headers={"traceparent":
                                      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        h.add_request("secret-req-b", prompts["secret-req-b"], max_tokens=6)
        while h.has_work():
            for r in h.scheduler.requests.values():
                hashes.update(bytes(b) for b in r.block_hashes)
                for group in h.scheduler.kv_cache_manager.get_block_ids(r.request_id):
                    if len(group) >= 2:
                        BLOCK_LISTS.append(tuple(group))
            h.step()
    current_pipeline().flush()
    assert hashes and pointers
    return pointers, hashes


def prompts() -> dict[str, list[int]]:
    # Token ids large enough not to be confused with ranks, epochs or counts.
    return {r: [50_000 + t for t in random_tokens(7, r, 80, 10_000)]
            for r in ("secret-req-a", "secret-req-b")}


def test_no_address_token_id_or_block_hash_leaves_the_process(observe):
    p = prompts()
    pointers, hashes = run_recovery(observe, p)
    assert observe.spans("kv.recovery") and observe.spans("kv.transfer")
    assert_nothing_private(*everything(observe), p, pointers, hashes)


def assert_nothing_private(scalars: list[tuple[str, Any]], lists: list[tuple[str, list]],
                           p: dict[str, list[int]], pointers: set[int], hashes: set[bytes]
                           ) -> None:
    unknown = sorted({k for k, _ in scalars if k not in ALLOWED_KEYS and k != "<span name>"})
    assert not unknown, f"attribute keys not reviewed for privacy: {unknown}"
    tokens = {t for toks in p.values() for t in toks}
    hex_hashes = {h.hex() for h in hashes}
    hex_pointers = {f"{ptr:x}" for ptr in pointers}
    for key, value in scalars:
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            assert value not in pointers, (key, value)
            assert value not in tokens, (key, value)
            # No address-sized ints (user-space addresses start above 2**32
            # on x86-64 Linux): only a byte count may be that large.
            assert value < 1 << 32 or key == "kvobs.bytes", (key, value)
        elif isinstance(value, float):
            # durations only: no tensor values
            assert key in ("kvobs.device.duration_s", "kvobs.receipt.spread_s"), (key, value)
        elif isinstance(value, bytes):
            pytest.fail(f"bytes exported under {key}")
        else:
            text = str(value).lower()
            assert not any(h in text for h in hex_hashes), (key, value)
            assert not any(ptr in text for ptr in hex_pointers), (key, value)
            assert "0x" not in text, (key, value)
    assert BLOCK_LISTS and JOB_IDS
    block_texts = {", ".join(map(str, b)) for b in BLOCK_LISTS} | {
        ",".join(map(str, b)) for b in BLOCK_LISTS}
    for key, value in scalars:
        if isinstance(value, str):
            assert not any(b in value for b in block_texts), (key, value)  # no block id list
    for key, seq in lists:
        # Id lists only: short ints, never a run of prompt tokens...
        assert all(isinstance(x, int) and x not in tokens for x in seq), (key, seq[:8])
        # ...and each a list of vLLM's job ids or of ranks, never of block ids.
        if key in ID_LISTS["jobs"]:
            assert set(seq) <= JOB_IDS, (key, seq[:8])
        else:
            assert key in ID_LISTS["ranks"] and set(seq) <= {0, 1}, (key, seq[:8])


def _any_value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def otlp_everything(rx) -> tuple[list[tuple[str, Any]], list[tuple[str, list]]]:
    """As ``everything``, from the OTLP requests as they arrived (a sidecar
    exports them): every span, event, link, resource and metric point."""
    groups: list[dict[str, Any]] = []
    names: list[str] = []

    def attrs(kvs: Any) -> dict[str, Any]:
        return {kv.key: _any_value(kv.value) for kv in kvs}

    with rx.store.lock:
        traces, metrics = list(rx.store.trace_requests), list(rx.store.metric_requests)
    for req in traces:
        for rs in req.resource_spans:
            groups.append(attrs(rs.resource.attributes))
            for ss in rs.scope_spans:
                for span in ss.spans:
                    names.append(span.name)
                    groups.append(attrs(span.attributes))
                    groups += [attrs(e.attributes) for e in span.events]
                    groups += [attrs(link.attributes) for link in span.links]
    for req in metrics:
        for rm in req.resource_metrics:
            groups.append(attrs(rm.resource.attributes))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    data = getattr(m, m.WhichOneof("data"))
                    for point in data.data_points:
                        groups.append(attrs(point.attributes))
                        groups += [attrs(ex.filtered_attributes)
                                   for ex in getattr(point, "exemplars", ())]
    scalars = [kv for g in groups for kv in _values(g)] + [("<span name>", n) for n in names]
    lists = [(k, list(v)) for g in groups for k, v in g.items() if isinstance(v, list)]
    return scalars, lists


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a pipe message, with where it sits."""
    if isinstance(value, type):
        return  # a lifecycle class, by reference
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k, path + "/key")
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        if len(value) >= 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                   for x in value):
            yield path, tuple(value)  # a run of ints: checked as a whole too
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}/{i}")
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _walk(getattr(value, name), f"{path}.{name}")
    else:
        yield path, value


def test_nothing_private_crosses_to_the_sidecar_or_leaves_it(monkeypatch):
    """The sidecar (the default export path) is a second process: what the
    vLLM process writes into its pipe is scanned like what it exports."""
    from kvobs_otel.sidecar import wire

    from otlp_receiver import HttpReceiver

    sent: list[tuple[Any, ...]] = []
    frame = wire.frame
    monkeypatch.setattr(wire, "frame", lambda m: (sent.append(m), frame(m))[1])
    p = prompts()
    with HttpReceiver() as rx:
        for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
                     "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                     "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_METRIC_EXPORT_INTERVAL": "200"
                     }.items():
            monkeypatch.setenv(k, v)
        assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                              drain_interval_s=0.02))
        try:
            pointers, hashes = run_recovery(None, p)
        finally:
            kvobs_otel.uninstrument()  # waits for the sidecar to flush and exit
        # The pipe (so a sidecar exported): no address, token id, block hash or
        # block id list either.
        assert any(m[0] == "events" for m in sent)
        tokens = {t for toks in p.values() for t in toks}
        hex_hashes = {h.hex() for h in hashes}
        blocks = set(BLOCK_LISTS)
        for where, value in _walk(sent):
            if isinstance(value, tuple):
                assert value not in blocks, (where, value)
                assert not any(value[i:i + 3] in {b[:3] for b in blocks}
                               for i in range(len(value) - 2)), (where, value)
            elif isinstance(value, int) and not isinstance(value, bool):
                assert value not in pointers and value not in tokens, (where, value)
            elif isinstance(value, (str, bytes)):
                text = value.hex() if isinstance(value, bytes) else value.lower()
                assert not any(h in text for h in hex_hashes), (where, value)
                assert not any(f"{ptr:x}" in text for ptr in pointers), (where, value)
        spans = list(rx.store.spans)
        assert {s.name for s in spans} >= {"kv.recovery", "kv.transfer"}
        assert assert_traces_match_vllm(HARNESS[0], spans) >= 1
        assert_nothing_private(*otlp_everything(rx), p, pointers, hashes)


KEY = b"0123456789abcdef-test-key"


def test_keyed_request_ids_hide_the_ids_and_keep_the_joins(telemetry):
    assert kvobs_otel.instrument(Settings(enabled=True, receipt_deadline_s=1.0,
                                          drain_interval_s=0.02, request_id_key=KEY))
    try:
        run_recovery(telemetry, prompts())
    finally:
        kvobs_otel.uninstrument()
    scalars, _ = everything(telemetry)
    assert not any("secret-req" in str(v) for _, v in scalars)
    ids = {v for k, v in scalars if k == "kvobs.request.id"}
    assert ids and all(v.startswith("rid-") and len(v) == 36 for v in ids)
    # The same key gives the same pseudonym in every process (and the CLI),
    # and every recovery vLLM made is still one complete trace under it.
    from kvobs_otel.identity import RequestIdHasher
    assert assert_traces_match_vllm(HARNESS[0], telemetry.spans(),
                                    request_id=RequestIdHasher(KEY)) >= 1
    episodes = rebuild(spans_from_document(spans_to_otlp_json(telemetry.spans())))
    assert {e.request_id for e in episodes} == {RequestIdHasher(KEY)("secret-req-a")}


def test_request_id_key_settings_are_validated(tmp_path, caplog):
    f = tmp_path / "key"
    f.write_bytes(KEY + b"\n")
    assert load_settings({"KVOBS_OTEL_REQUEST_ID_KEY_FILE": str(f)}).request_id_key == KEY
    assert load_settings({"KVOBS_OTEL_REQUEST_ID_KEY": KEY.decode()}).request_id_key == KEY
    assert "0123456789" not in repr(load_settings({"KVOBS_OTEL_REQUEST_ID_KEY": KEY.decode()}))
    bad = [({"KVOBS_OTEL_REQUEST_ID_KEY": "short"}, "KVOBS_OTEL_REQUEST_ID_KEY:"),
           ({"KVOBS_OTEL_REQUEST_ID_KEY_FILE": str(tmp_path / "none")},
            "KVOBS_OTEL_REQUEST_ID_KEY_FILE="),
           ({"KVOBS_OTEL_REQUEST_ID_KEY_FILE": str(f), "KVOBS_OTEL_REQUEST_ID_KEY": "x" * 20},
            "both set")]
    for env, message in bad:
        with pytest.raises(ConfigError, match=message) as e:
            load_settings(env)
        assert "short" not in str(e.value)  # a secret is never echoed
    with caplog.at_level(logging.ERROR, logger="kvobs_otel"):
        import os
        os.environ["KVOBS_OTEL_REQUEST_ID_KEY"] = "short"
        try:
            assert not kvobs_otel.instrument(default_enabled=True)
        finally:
            del os.environ["KVOBS_OTEL_REQUEST_ID_KEY"]
    assert not kvobs_otel.is_instrumented()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "KVOBS_OTEL_REQUEST_ID_KEY" in line and "stays off" in line
