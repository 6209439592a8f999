"""What a supported vLLM release declares (``Release``: the classes, methods
and dataclass fields the seams rely on, and the few readers that differ) and
how a declaration is checked against the installed vLLM. The release modules
(``v0_32``...) build on this; the package chooses among them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

# Where the seams attach (module paths of the installed vLLM).
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnector"
BASE_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"
CONNECTOR_WORKER = ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
                    "OffloadingConnectorWorker")
COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
OFFLOAD_BASE = "vllm.v1.kv_offload.base"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
TIERING = "vllm.v1.kv_offload.tiering"
MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector"

def _no_failures(meta: Any) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True)
class Release:
    series: tuple[int, int]  # (0, 34)
    tested: str  # the exact release CI runs: "0.34.0"
    # "module:Qualname" -> parameter names of a method (``**kw`` for keyword
    # catch-alls), or the field names a dataclass must have (a subset: fields
    # vLLM adds are carried by name, see metadata.py).
    methods: Mapping[str, tuple[str, ...]]
    dataclass_fields: Mapping[str, tuple[str, ...]]
    # (job_id, TransferJob) -> (job_id, req_id, sync, blocks) for a load job.
    load_row: Callable[[int, Any], tuple[Any, ...]]
    # vLLM's worker metadata -> ids of jobs whose transfer failed (vLLM's
    # own set where it has one).
    failed_jobs: Callable[[Any], Collection[int]] = _no_failures
    # The model runners this release has (the harness drives each).
    runners: tuple[str, ...] = ("v2",)
    # What a trace from this release lacks or adds, for the docs and doctor.
    notes: tuple[str, ...] = ()
    # The secondary tiers' shape (TieringOffloadingSpec), checked apart: when
    # it differs only the tiers go untraced (tier_seams.py).
    tier_methods: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    tier_fields: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # vLLM's MultiConnector (the OffloadingConnector composed with others),
    # checked apart too: when it differs, the tokens the other connectors
    # bring back stay unattributed (seams.py).
    multi_methods: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return ".".join(map(str, self.series))

    def tier_problems(self) -> list[str]:
        """Where the installed tiering classes differ from this release's
        tier seams (empty: they fit). Checked once per process."""
        return self._part_problems("tier", self.tier_methods, self.tier_fields)

    def multi_problems(self) -> list[str]:
        """Where the installed MultiConnector differs from its seam."""
        return self._part_problems("MultiConnector", self.multi_methods, {})

    def _part_problems(self, part: str, methods: Mapping[str, tuple[str, ...]],
                       fields: Mapping[str, tuple[str, ...]]) -> list[str]:
        got = _PART_CHECKED.get((self.series, part))
        if got is None:
            got = _PART_CHECKED[(self.series, part)] = (
                _differences(methods, fields) if methods
                else [f"vLLM {self.name} declares no {part} seams"])
        return got


_PART_CHECKED: dict[tuple[tuple[int, int], str], list[str]] = {}


def blocks(spec: Any) -> int:
    ids = getattr(spec, "block_ids", None)
    return len(ids) if ids is not None else 0


def resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def parameters(fn: Any) -> tuple[str, ...]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        elif p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
        else:
            out.append(p.name)
    return tuple(out)


def check_shape(release: Release) -> list[str]:
    """Every difference between ``release``'s declared shape and the
    installed vLLM, one line each (empty: the seams fit)."""
    return _differences(release.methods, release.dataclass_fields)


def _differences(methods: Mapping[str, tuple[str, ...]],
                 fields: Mapping[str, tuple[str, ...]]) -> list[str]:
    problems = []
    for path, want in methods.items():
        try:
            got = parameters(resolve(path))
        except Exception as e:  # missing module, class or method
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if got != want:
            problems.append(f"{path}{_sig(got)}, expected {_sig(want)}")
    for path, want in fields.items():
        try:
            cls = resolve(path)
            got = tuple(f.name for f in dataclasses.fields(cls))
        except Exception as e:
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        missing = [f for f in want if f not in got]
        if missing:
            problems.append(f"{path} lacks field(s) {', '.join(missing)}")
    return problems


def _sig(params: tuple[str, ...]) -> str:
    return "(" + ", ".join(params) + ")"
