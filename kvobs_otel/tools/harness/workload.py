"""Deterministic workloads for the harness.

``pressure_workload`` is sized against the harness' GPU block budget so the
real scheduler has to preempt, and so that the preempted requests' freed
blocks get reused by the others before they are re-admitted: their KV then
comes back from the CPU tier through a load job (a restore), not from the GPU
prefix cache. Checking ``restore_events`` after a run tells whether that
happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvobs_otel.tools.harness.fabricate import random_tokens

if TYPE_CHECKING:
    from kvobs_otel.tools.harness.engine import Harness


@dataclass(frozen=True)
class PromptSpec:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def make_prompts(
    n: int,
    prompt_len: int,
    *,
    seed: int = 0,
    vocab_size: int = 256,
    shared_prefix_len: int = 0,
    num_prefix_groups: int = 1,
    prefix: str = "req",
) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` random tokens.

    The first ``shared_prefix_len`` tokens are shared by every prompt of the
    same group (prompt ``i`` is in group ``i % num_prefix_groups``), so prefix
    caching and offload hits have something to find.
    """
    shared = [
        random_tokens(seed, f"{prefix}-shared-{g}", shared_prefix_len, vocab_size)
        for g in range(max(1, num_prefix_groups))
    ]
    prompts = []
    for i in range(n):
        head = shared[i % len(shared)] if shared_prefix_len else []
        tail = random_tokens(seed, f"{prefix}-{i}", prompt_len - len(head), vocab_size)
        prompts.append(head + tail)
    return prompts


def pressure_workload(
    harness: Harness,
    *,
    num_requests: int | None = None,
    prompt_len: int | None = None,
    max_tokens: int | None = None,
    shared_prefix_len: int = 0,
    prefix: str = "p",
) -> list[PromptSpec]:
    """Add requests whose combined KV needs well exceed the GPU blocks.

    Sizing (defaults, from the harness config): with ``U`` usable GPU blocks
    and ``R = min(max_num_seqs, 3)`` requests admitted side by side, every
    prompt takes about ``U / R`` blocks, so ``R`` prompts fit at admission;
    the outputs are long enough that ``R`` growing requests outgrow the cache
    (the scheduler preempts the newest) and the ``R - 1`` survivors alone
    outgrow what the preemption left free, so they reuse the preempted
    request's freed blocks. Its GPU prefix-cache hits are then gone and its
    re-admission loads the prompt back from the CPU tier (a restore).
    ``shared_prefix_len`` makes every prompt start with the same tokens; the
    shared blocks stay on GPU and are left out of the sizing.
    """
    cfg = harness.config
    bs = cfg.block_size
    concurrent = min(cfg.max_num_seqs, 3)
    if concurrent < 2:
        raise ValueError("memory pressure needs max_num_seqs >= 2")
    shared_blocks = shared_prefix_len // bs
    usable = cfg.num_gpu_blocks - 1 - shared_blocks  # one block is the null block
    unique_prompt_blocks = max(1, usable // concurrent - 1)
    output_blocks = max(
        2,
        -(-(usable - unique_prompt_blocks // 2) // (concurrent - 1)) - unique_prompt_blocks + 1,
    )
    if prompt_len is None:
        prompt_len = (shared_blocks + unique_prompt_blocks) * bs
    if max_tokens is None:
        max_tokens = output_blocks * bs
    if num_requests is None:
        num_requests = 2 * concurrent + 2
    prompts = make_prompts(
        num_requests,
        prompt_len,
        seed=cfg.seed,
        vocab_size=harness.model.vocab_size,
        shared_prefix_len=shared_prefix_len,
        prefix=prefix,
    )
    specs = [PromptSpec(f"{prefix}{i}", toks, max_tokens) for i, toks in enumerate(prompts)]
    for spec in specs:
        harness.add_request(spec.req_id, spec.prompt_token_ids, spec.max_tokens)
    return specs
