"""``kvobs-otel check`` on vLLM 0.34's failed restores, from spans built by hand.

A failed restore ends an episode properly: ``restore_failed`` (vLLM ended the
request with an error: no admission) or ``recomputed`` (vLLM computed it again
from scratch: one prefill admission, a first compute on every rank). Its chain
is judged like any other, with the restore transfers allowed to have failed
and at least one failed on a rank the episode names. Consistent ones are
complete (exit 0; the alert reports the failure) and counted on their own.
"""

from __future__ import annotations

import hashlib
import json
from itertools import count

import pytest

from kvobs_otel.tools import cli
from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.check import check_spans, format_table
from kvobs_otel.tools.otlp_file import FileSpan

RANKS = 2
_ids = count(1)
_jobs = count(1)


def _span(name: str, trace_id: str, parent: str, attrs: dict, *, start: int, end: int,
          error: bool = False, rank: int | None = None) -> FileSpan:
    resource = {"service.name": "kvobs-otel",
                "kvobs.role": "scheduler" if rank is None else "worker"}
    if rank is not None:
        resource["kvobs.rank"] = rank
    return FileSpan(name=name, trace_id=trace_id, span_id=f"{next(_ids):016x}",
                    parent_span_id=parent, start_ns=start, end_ns=end, attributes=attrs,
                    resource=resource, error=error)


def episode(outcome: str, req: str = "r", *, failed_ranks: tuple[int, ...] = (1,),
            transfer_outcomes: dict[int, str] | None = None,
            admissions: int | None = None, compute_kind: str = "prefill",
            first_compute_ranks: tuple[int, ...] | None = None,
            name_failure: bool = True) -> list[FileSpan]:
    """One episode's trace as kvobs-otel writes it: root, a preserve store, a
    restore load whose transfer failed on ``failed_ranks``, and the admission
    and first computes the outcome calls for (overridable). ``transfer_outcomes``
    maps a rank to its restore transfer's outcome (None: no span)."""
    trace = hashlib.sha256(f"{outcome}/{req}/{next(_ids)}".encode()).hexdigest()[:32]
    preserve, restore = next(_jobs), next(_jobs)
    t0 = 1_000_000_000
    failed_restore = outcome in ("restore_failed", "recomputed")
    came_back = outcome in ("recovered", "recomputed")
    if transfer_outcomes is None:
        transfer_outcomes = {r: "failed" if failed_restore and r in failed_ranks else "ok"
                             for r in range(RANKS)}
    if admissions is None:
        admissions = 1 if came_back else 0
    if first_compute_ranks is None:
        first_compute_ranks = tuple(range(RANKS)) if came_back else ()
    root_attrs: dict = {
        "kvobs.request.id": req, "kvobs.recovery.epoch": 1,
        "kvobs.scheduler.generation": "g" * 32, "kvobs.outcome": outcome,
        "kvobs.receipt.expected_ranks": RANKS, "kvobs.preserve.job_ids": [preserve],
        "kvobs.restore.job_ids": [restore],
    }
    if failed_restore and name_failure:
        root_attrs["kvobs.restore.failed_job_ids"] = [restore]
        root_attrs["kvobs.restore.failed_ranks"] = list(failed_ranks)
    if came_back:
        root_attrs["kvobs.first_compute.ranks"] = list(first_compute_ranks)
        root_attrs["kvobs.compute.kind"] = compute_kind
        root_attrs["kvobs.tokens.discarded"] = 48
        root_attrs["kvobs.tokens.restored"] = 0 if failed_restore else 32
        root_attrs["kvobs.tokens.resident"] = 16
        root_attrs["kvobs.tokens.recomputed"] = 32 if failed_restore else 0
    root = _span("kv.recovery", trace, "", root_attrs, start=t0, end=t0 + 90_000_000,
                 error=outcome == "restore_failed")
    spans = [root]
    job_failed = failed_restore and any(o == "failed" for o in transfer_outcomes.values())
    for job_id, kind, role, direction, start in ((preserve, "store", "preserve", "d2h", 1),
                                                 (restore, "load", "restore", "h2d", 20)):
        failed = job_failed and kind == "load"
        job = _span("kv.job", trace, root.span_id, {
            "kvobs.job.id": job_id, "kvobs.job.kind": kind, "kvobs.job.role": role,
            "kvobs.receipt.expected_ranks": RANKS, "kvobs.receipt.ranks": list(range(RANKS)),
            "kvobs.receipt.missing_ranks": [], "kvobs.outcome": "failed" if failed else "complete",
            **({"kvobs.receipt.failed_ranks": list(failed_ranks)} if failed else {}),
        }, start=t0 + start * 1_000_000, end=t0 + (start + 10) * 1_000_000, error=failed)
        spans.append(job)
        for rank in range(RANKS):
            outcome_r = transfer_outcomes.get(rank, "ok") if kind == "load" else "ok"
            if outcome_r is None:
                continue  # this rank's transfer span is missing
            spans.append(_span("kv.transfer", trace, job.span_id, {
                "kvobs.job.id": job_id, "kvobs.direction": direction, "kvobs.rank": rank,
                "kvobs.outcome": outcome_r,
            }, start=job.start_ns + 1, end=job.end_ns - 1, error=outcome_r != "ok", rank=rank))
    for _ in range(admissions):
        adm = _span("kv.admission", trace, root.span_id, {
            "kvobs.request.id": req, "kvobs.recovery.epoch": 1,
            "kvobs.compute.kind": compute_kind, "kvobs.admission.roster": [restore],
        }, start=t0 + 40_000_000, end=t0 + 50_000_000)
        spans.append(adm)
        for rank in first_compute_ranks:
            spans.append(_span("kv.first_compute", trace, adm.span_id, {
                "kvobs.request.id": req, "kvobs.recovery.epoch": 1, "kvobs.rank": rank,
                "kvobs.compute.kind": compute_kind,
            }, start=t0 + 60_000_000, end=t0 + 90_000_000, rank=rank))
    return spans


def judged(spans: list[FileSpan]):
    (ep,) = rebuild(spans)
    return ep


# -- consistent failed restores are complete ------------------------------------


def test_consistent_restore_failed_episode_is_complete():
    ep = judged(episode("restore_failed"))
    assert ep.outcome == "restore_failed"
    assert ep.complete, ep.problems
    assert (ep.failed_restore_jobs, ep.failed_ranks) == (ep.restore_jobs, [1])


def test_consistent_recomputed_episode_is_complete():
    ep = judged(episode("recomputed"))
    assert ep.outcome == "recomputed"
    assert ep.complete, ep.problems


def test_a_failure_on_every_rank_is_consistent_too():
    assert judged(episode("restore_failed", failed_ranks=(0, 1))).complete
    assert judged(episode("recomputed", failed_ranks=(0, 1))).complete


# -- inconsistent ones are reported ---------------------------------------------


def test_recomputed_missing_a_ranks_first_compute_is_reported():
    ep = judged(episode("recomputed", first_compute_ranks=(0,)))
    assert not ep.complete
    assert ep.problems == ["first compute missing on ranks [1]"]


def test_restore_failed_with_an_admission_is_reported():
    ep = judged(episode("restore_failed", admissions=1, first_compute_ranks=()))
    assert not ep.complete
    assert ep.problems == ["admission present (1) after the request failed"]


def test_restore_failed_with_first_computes_is_reported():
    ep = judged(episode("restore_failed", admissions=1, first_compute_ranks=(0, 1)))
    assert "first compute present on ranks [0, 1] after the request failed" in ep.problems


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"admissions": 0, "first_compute_ranks": ()}, "admission missing"),
    ({"admissions": 2}, "admission duplicated (2)"),
    ({"compute_kind": "decode"}, "recomputed but admitted as decode, not prefill"),
])
def test_recomputed_needs_one_prefill_admission(kwargs, problem):
    ep = judged(episode("recomputed", **kwargs))
    assert problem in ep.problems, ep.problems


@pytest.mark.parametrize("outcome", ["restore_failed", "recomputed"])
def test_failed_restore_without_a_failed_transfer_on_a_named_rank_is_reported(outcome):
    # Every transfer ok: nothing shows the failure the episode claims.
    ep = judged(episode(outcome, transfer_outcomes={0: "ok", 1: "ok"}))
    assert "no failed restore transfer on failed ranks [1]" in ep.problems, ep.problems
    # The failure on another rank than the one named.
    ep = judged(episode(outcome, transfer_outcomes={0: "failed", 1: "ok"}))
    assert "no failed restore transfer on failed ranks [1] (failed on ranks [0])" in ep.problems


@pytest.mark.parametrize("outcome", ["restore_failed", "recomputed"])
def test_failed_restore_still_needs_a_transfer_from_every_rank(outcome):
    ep = judged(episode(outcome, transfer_outcomes={0: None, 1: "failed"}))
    assert ep.problems == [f"restore job {ep.restore_jobs[0]}: restore missing on ranks [0]"]


def test_failed_restore_must_name_its_failed_jobs_and_ranks():
    ep = judged(episode("restore_failed", name_failure=False))
    assert "failed restore names no job (kvobs.restore.failed_job_ids)" in ep.problems
    assert "failed restore names no rank (kvobs.restore.failed_ranks)" in ep.problems


def test_failed_restore_naming_a_job_outside_the_episode_is_reported():
    spans = episode("recomputed")
    spans[0].attributes["kvobs.restore.failed_job_ids"] = [999]
    ep = judged(spans)
    assert "failed restore jobs [999] are not restore jobs of the episode" in ep.problems
    assert "no failed restore transfer on failed ranks [1]" in ep.problems


def test_recovered_episode_still_needs_every_restore_ok():
    # Only a failed restore's transfers may have failed.
    ep = judged(episode("recovered", transfer_outcomes={0: "ok", 1: "failed"}))
    assert ep.problems == [f"restore job {ep.restore_jobs[0]}: restore missing on ranks [1]"]
    assert judged(episode("recovered")).complete


# -- summary, table, exit status --------------------------------------------------


def mixed() -> list[FileSpan]:
    return (episode("recovered", "a") + episode("restore_failed", "b")
            + episode("recomputed", "c") + episode("recomputed", "d", first_compute_ranks=(0,)))


def test_summary_counts_failed_restores_separately():
    episodes, summary = check_spans(mixed())
    assert len(episodes) == 4
    assert (summary["episodes"], summary["complete"], summary["incomplete"]) == (4, 3, 1)
    assert (summary["restore_failed"], summary["recomputed"]) == (1, 2)
    (bad,) = summary["incomplete_episodes"]
    assert (bad["request_id"], bad["outcome"]) == ("d", "recomputed")
    failed = {e["request_id"]: e for e in summary["failed_restore_episodes"]}
    assert set(failed) == {"b", "c", "d"}
    (b,) = [e for e in episodes if e.request_id == "b"]
    assert failed["b"] == {"request_id": "b", "epoch": 1, "trace_id": b.trace_id,
                           "outcome": "restore_failed", "failed_job_ids": b.restore_jobs,
                           "failed_ranks": [1], "complete": True}
    assert not failed["d"]["complete"]
    json.dumps(summary)  # --json prints it

    table = format_table(episodes)
    assert table.splitlines()[-1] == (
        "4 recovery episodes: 3 complete, 1 incomplete; restore_failed: 1, recomputed: 2")
    assert "first compute missing on ranks [1]" in table and "\nb " not in table
    assert "\nb " in "\n" + format_table(episodes, show_all=True)


def test_summary_of_no_failed_restores_counts_zero():
    episodes, summary = check_spans(episode("recovered"))
    assert (summary["restore_failed"], summary["recomputed"]) == (0, 0)
    assert summary["failed_restore_episodes"] == []
    assert format_table(episodes).endswith(
        "1 recovery episodes: 1 complete, 0 incomplete; restore_failed: 0, recomputed: 0")


def _otlp_json(spans: list[FileSpan]) -> str:
    """FileSpans back to OTLP/JSON lines (one resource per span)."""
    def value(v):
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        if isinstance(v, float):
            return {"doubleValue": v}
        if isinstance(v, list):
            return {"arrayValue": {"values": [value(x) for x in v]}}
        return {"stringValue": str(v)}

    def attrs(d):
        return [{"key": k, "value": value(v)} for k, v in d.items()]

    return "\n".join(json.dumps({"resourceSpans": [{
        "resource": {"attributes": attrs(s.resource)},
        "scopeSpans": [{"spans": [{
            "name": s.name, "traceId": s.trace_id, "spanId": s.span_id,
            "parentSpanId": s.parent_span_id, "startTimeUnixNano": str(s.start_ns),
            "endTimeUnixNano": str(s.end_ns), "attributes": attrs(s.attributes),
            "status": {"code": 2 if s.error else 0}}]}]}]}) for s in spans) + "\n"


def test_exit_status_0_when_failed_restores_are_consistent(tmp_path, capsys):
    path = tmp_path / "failed.otlp.jsonl"
    path.write_text(_otlp_json(episode("restore_failed", "b") + episode("recomputed", "c")))
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("2 complete, 0 incomplete; restore_failed: 1, recomputed: 1")
    assert cli.main(["check", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["incomplete"], data["restore_failed"], data["recomputed"]) == (0, 1, 1)


def test_exit_status_1_when_a_failed_restore_is_inconsistent(tmp_path, capsys):
    path = tmp_path / "bad.otlp.jsonl"
    path.write_text(_otlp_json(episode("restore_failed", "b", admissions=1)))
    assert cli.main(["check", str(path)]) == 1
    assert "admission present (1) after the request failed" in capsys.readouterr().out


# -- episodes cut short by a process stop (issue 31) ------------------------------


def process_end(rank: int | None, last_event_ns: int, end_ns: int) -> FileSpan:
    """The span a killed vLLM process's sidecar sends: from its last event
    that left it to its pipe's end (its own trace)."""
    attrs = {"kvobs.end.cause": "process_killed", "kvobs.scheduler.generation": "g" * 32,
             "kvobs.process.unsent_events": 3}
    if rank is not None:
        attrs["kvobs.rank"] = rank
    return _span("kv.process.end", f"{next(_ids):032x}", "", attrs, start=last_event_ns,
                 end=end_ns, rank=rank)


def test_spans_a_killed_rank_never_handed_over_cut_the_episode_short():
    spans = episode("recovered", first_compute_ranks=(0,))
    root = spans[0]
    # Without a kill: rank 1 never answered.
    ep = judged(spans)
    assert ep.problems == ["first compute missing on ranks [1]"] and not ep.cut_short
    # Rank 1's process was killed, its last event out before the episode ended.
    ep = judged(spans + [process_end(1, root.end_ns - 30_000_000, root.end_ns + 5)])
    assert ep.complete and ep.cut_short == [
        "first compute on rank 1: its process was killed before handing it over "
        "(kv.process.end)"]
    # Killed, but it handed over events after the episode ended: its missing
    # first compute is no kill's doing.
    ep = judged(spans + [process_end(1, root.end_ns + 1_000_000, root.end_ns + 2_000_000)])
    assert ep.problems == ["first compute missing on ranks [1]"]
    # Another rank's kill explains nothing here.
    ep = judged(spans + [process_end(0, root.start_ns, root.end_ns)])
    assert ep.problems == ["first compute missing on ranks [1]"]


def test_an_abandoned_episode_is_cut_short_not_incomplete(tmp_path, capsys):
    """vLLM stopped while the restore was out: the episode and its job end as
    abandoned with their cause, the restore transfer of rank 1 never came."""
    spans = episode("finished_before_resume", "a", transfer_outcomes={0: "ok", 1: None})
    for s in spans:
        load_job = s.name == "kv.job" and s.attributes["kvobs.job.kind"] == "load"
        if s.name == "kv.recovery" or load_job:
            s.attributes["kvobs.outcome"] = "abandoned"
            s.attributes["kvobs.end.cause"] = "process_killed"
        if load_job:
            s.attributes["kvobs.receipt.ranks"] = [0]
    ep = judged(spans)
    assert ep.complete, ep.problems
    assert ep.cut_short == ["abandoned: process_killed"]
    # The same trace without the cut: the process stop is what excuses it.
    root = spans[0]
    root.attributes["kvobs.outcome"] = "receipt_incomplete"
    assert not judged(spans).complete
    root.attributes["kvobs.outcome"] = "abandoned"
    root.attributes["kvobs.end.cause"] = "evidence_ended"  # import-hust: records ended
    assert "outcome abandoned" in judged(spans).problems
    root.attributes["kvobs.end.cause"] = "process_killed"

    path = tmp_path / "cut.otlp.jsonl"
    path.write_text(_otlp_json(spans))
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 complete, 0 incomplete" in out
    assert "1 cut short when a vLLM process stopped" in out
    assert cli.main(["check", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cut_short"] == 1
    assert data["cut_short_episodes"][0]["why"] == ["abandoned: process_killed"]
