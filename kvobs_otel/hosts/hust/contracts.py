"""Find the vLLM-HUST contract modules and admit only versions we know.

Fail closed for the adapter, never for vLLM: a module that claims another
contract or API version, or lacks the registration functions, is refused
with one log line and a counted reason, and nothing is registered with it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger("kvobs_otel")

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading."


@dataclass(frozen=True)
class Contract:
    key: str  # "v1" | "v2"
    module: str
    name: str
    api_version: str
    register: str
    unregister: str
    name_constant: str  # the module constants that name the contract and its API version
    version_constant: str


# Names as in the fork's modules (docs/hosts.md, "Facts the adapter relies on").
V2 = Contract("v2", _BASE + "correlated_observability", "vllm.kv-transfer.observer.v2", "2.0",
              "register_correlated_observer", "unregister_correlated_observer",
              "KV_TRANSFER_CORRELATED_OBSERVER_CONTRACT",
              "KV_TRANSFER_CORRELATED_OBSERVABILITY_API_VERSION")
V1 = Contract("v1", _BASE + "observability", "vllm.kv-transfer.observer.v1", "1.0",
              "register_kv_transfer_observer", "unregister_kv_transfer_observer",
              "KV_TRANSFER_OBSERVER_CONTRACT", "KV_TRANSFER_OBSERVABILITY_API_VERSION")
CONTRACTS = (V2, V1)  # order of preference

# Reasons a contract module is refused (metric label values; keep stable).
UNKNOWN_CONTRACT = "contract_unknown"
UNKNOWN_API_VERSION = "contract_unknown_api_version"
MISSING_API = "contract_missing_api"
IMPORT_FAILED = "contract_import_failed"
CONTRACT_REASONS = (UNKNOWN_CONTRACT, UNKNOWN_API_VERSION, MISSING_API, IMPORT_FAILED)


@dataclass
class Detection:
    """What start-up found: admitted modules by contract key, and refusals."""

    admitted: dict[str, ModuleType] = field(default_factory=dict)
    refused: list[tuple[Contract, str, str]] = field(default_factory=list)  # (c, reason, detail)

    @property
    def present(self) -> bool:
        """The fork is there (even if every contract was refused)."""
        return bool(self.admitted or self.refused)

    @property
    def chosen(self) -> Contract | None:
        for c in CONTRACTS:
            if c.key in self.admitted:
                return c
        return None


def check_module(contract: Contract, module: Any) -> tuple[str, str] | None:
    """(reason, detail) when ``module`` is not the contract we know, else None."""
    name = getattr(module, contract.name_constant, None)
    version = getattr(module, contract.version_constant, None)
    if name != contract.name:
        return UNKNOWN_CONTRACT, f"contract {name!r}, expected {contract.name!r}"
    if version != contract.api_version:
        return UNKNOWN_API_VERSION, (f"{contract.name} API version {version!r}, "
                                     f"expected {contract.api_version!r}")
    for fn in (contract.register, contract.unregister):
        if not callable(getattr(module, fn, None)):
            return MISSING_API, f"{contract.name} has no callable {fn}()"
    return None


def detect(import_module: Callable[[str], ModuleType] = importlib.import_module) -> Detection:
    """Look for both contracts; never raises."""
    found = Detection()
    for contract in CONTRACTS:
        try:
            module = import_module(contract.module)
        except ModuleNotFoundError as e:
            if e.name and contract.module.startswith(e.name):
                continue  # stock vLLM: the fork's module is simply not there
            found.refused.append((contract, IMPORT_FAILED, str(e)))
            continue
        except Exception as e:  # a broken fork module must not break vLLM
            found.refused.append((contract, IMPORT_FAILED, f"{type(e).__name__}: {e}"))
            continue
        problem = check_module(contract, module)
        if problem is None:
            found.admitted[contract.key] = module
        else:
            found.refused.append((contract, *problem))
    for contract, reason, detail in found.refused:
        logger.error("kvobs-otel: vLLM-HUST %s refused (%s): %s; not observing through it",
                     contract.key, reason, detail)
    return found
