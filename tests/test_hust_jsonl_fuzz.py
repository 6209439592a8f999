"""The vLLM-HUST plugin's JSONL lines, fuzzed from the real shapes.

Seeds are the fixture lines (``tests/fixtures/hust/``, the plugin's layout).
Properties: reading never raises; every line is either a record or refused
with a known reason; what the plugin's validator refuses by construction
(a missing key, an unknown key, a value of another JSON type, a null) is
refused here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvobs_otel.hosts.hust import jsonl, plugin_records
from kvobs_otel.hosts.hust import records as R

FIXTURES = Path(__file__).parent / "fixtures" / "hust"
SEEDS = [json.loads(x) for p in sorted(FIXTURES.glob("*.jsonl"))
         for x in p.read_text().splitlines()]
REASONS = set(R.RECORD_REASONS) | set(plugin_records.LINE_REASONS)
LINE_REASONS = REASONS | {jsonl.TOO_LARGE, jsonl.NOT_JSON, jsonl.TRUNCATED,
                          jsonl.DUPLICATE_KEY, jsonl.NON_FINITE, jsonl.NOT_OBJECT,
                          jsonl.UNKNOWN_SCHEMA}
FUZZ = settings(max_examples=300, deadline=None)

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=False) | st.text(max_size=40),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=3),
                    max_leaves=6)


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a line: keys of objects, indexes of arrays."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(paths(v, prefix + (k,)))
    return out


def at(obj: Any, path: tuple) -> tuple[Any, Any]:
    for k in path[:-1]:
        obj = obj[k]
    return obj, path[-1]


def json_type(v: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list",
            dict: "dict", type(None): "null"}[type(v)]


def check(obj: Any) -> tuple[dict | None, str | None]:
    if not isinstance(obj, dict) or obj.get("schema") not in plugin_records.SCHEMAS:
        return None, "skip"
    _schema, d, reason = plugin_records.check_line(obj)
    return d, reason


def test_seeds_are_accepted() -> None:
    for seed in SEEDS:
        d, reason = check(seed)
        assert d is not None and reason is None, (seed, reason)


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_any_value_anywhere_never_raises(seed: dict, data: st.DataObject) -> None:
    line = json.loads(json.dumps(seed))
    where = data.draw(st.sampled_from(paths(line)))
    parent, key = at(line, where)
    old = parent[key]
    new = data.draw(JSON)
    parent[key] = new
    d, reason = check(line)
    assert (d is None) != (reason is None)
    if d is None:
        assert reason in REASONS | {"skip"}
    elif where != ("schema",):
        # A value of another JSON type is never a record the plugin writes
        # (bool vs int counts as another type).
        # (an identity's epoch is null or a positive int, both written)
        types = {json_type(old), json_type(new)}
        assert len(types) == 1 or (where == ("identity", "recovery_epoch")
                                   and types == {"null", "int"}), (where, new)


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_a_missing_or_unknown_key_is_refused(seed: dict, data: st.DataObject) -> None:
    line = json.loads(json.dumps(seed))
    objects = [p for p in paths(line) if isinstance(at(line, p)[0], dict) and p != ("schema",)]
    where = data.draw(st.sampled_from(objects))
    parent, key = at(line, where)
    if data.draw(st.booleans()):
        del parent[key]
    else:
        extra = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in parent))
        parent[extra] = data.draw(JSON)
    d, reason = check(line)
    assert d is None and reason in REASONS, (where, reason)


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_a_null_anywhere_but_an_unset_epoch_is_refused(seed: dict, data: st.DataObject) -> None:
    line = json.loads(json.dumps(seed))
    where = data.draw(st.sampled_from([p for p in paths(line) if p != ("schema",)]))
    parent, key = at(line, where)
    if parent[key] is None:
        return  # identity.recovery_epoch is null on the plugin's transfer records
    parent[key] = None
    d, reason = check(line)
    if where == ("identity", "recovery_epoch") and seed["event"] not in (
            "recovery_requeued", "recovery_admitted", "first_compute"):
        assert d is not None  # the plugin writes it so
    else:
        assert d is None and reason in REASONS


@FUZZ
@given(st.lists(st.sampled_from(SEEDS), min_size=1, max_size=12), st.binary(max_size=64),
       st.integers(0, 4000), st.data())
def test_damaged_files_never_raise_and_every_line_is_accounted_for(
        tmp_path_factory: Any, seeds: list, junk: bytes, cut: int, data: st.DataObject) -> None:
    text = "".join(json.dumps(s, separators=(",", ":"), sort_keys=True) + "\n"
                   for s in seeds).encode()
    at_ = data.draw(st.integers(0, len(text)))
    blob = (text[:at_] + junk + text[at_:])[: len(text) + len(junk) - cut % 50]
    f = tmp_path_factory.mktemp("fz") / "x.jsonl"
    f.write_bytes(blob)
    ev = jsonl.read_evidence([str(f)])
    assert set(ev.refused) <= LINE_REASONS
    assert ev.records + sum(ev.refused.values()) == ev.lines
