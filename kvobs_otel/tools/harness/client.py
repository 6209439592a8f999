"""Load for the real engine from a real client: concurrent streamed
completions through the ``openai`` package, some carrying a W3C
``traceparent`` (vLLM passes it into the request's trace headers, which
kvobs-otel links the recovery episode to).

Each request asks for exactly ``max_tokens`` tokens (``ignore_eos`` +
``min_tokens``), so every run does the same work and variants compare.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvobs_otel.tools.harness.model_files import corpus


@dataclass
class Completion:
    index: int
    request_id: str = ""  # sent as X-Request-Id: vLLM builds its request id on it
    trace_id: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    error: str | None = None

    def owns(self, vllm_request_id: str) -> bool:
        """Whether vLLM's request id (``cmpl-<X-Request-Id>-<n>-<suffix>`` in
        vLLM 0.32) is this completion's."""
        return f"-{self.request_id}-" in vllm_request_id

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.tokens - 1)


@dataclass
class LoadResult:
    completions: list[Completion] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Completion]:
        return [c for c in self.completions if c.error is None]

    @property
    def errors(self) -> list[Completion]:
        return [c for c in self.completions if c.error is not None]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(c.tokens for c in self.ok) / self.wall_s if self.wall_s else 0.0

    def median_ttft_s(self) -> float | None:
        v = [c.ttft_s for c in self.ok if c.ttft_s is not None]
        return statistics.median(v) if v else None

    def median_tpot_s(self) -> float | None:
        v = [t for c in self.ok if (t := c.tpot_s) is not None]
        return statistics.median(v) if v else None

    @property
    def trace_ids(self) -> set[str]:
        return {c.trace_id for c in self.completions if c.trace_id}


def traceparent_for(index: int, salt: str = "") -> tuple[str, str]:
    """A deterministic, valid W3C traceparent and its trace id."""
    digest = hashlib.sha256(f"{salt}/{index}".encode()).hexdigest()
    trace_id, span_id = digest[:32], digest[32:48]
    return f"00-{trace_id}-{span_id}-01", trace_id


async def _one(client: object, model: str, i: int, prompt: str, max_tokens: int,
               traced: bool, salt: str, sem: asyncio.Semaphore,
               on_done: Callable[[Completion], None] | None) -> Completion:
    c = Completion(index=i, request_id=f"{salt}-{i}")
    headers = {"X-Request-Id": c.request_id}
    if traced:
        headers["traceparent"], c.trace_id = traceparent_for(i, salt)
    async with sem:
        t0 = time.perf_counter()
        try:
            stream = await client.completions.create(  # type: ignore[attr-defined]
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                stream=True, extra_headers=headers,
                extra_body={"ignore_eos": True, "min_tokens": max_tokens},
                stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and c.ttft_s is None:
                    c.ttft_s = time.perf_counter() - t0
                if chunk.usage is not None:
                    c.tokens = chunk.usage.completion_tokens
        except Exception as e:  # counted per request; the caller decides
            c.error = f"{type(e).__name__}: {e}"
        c.latency_s = time.perf_counter() - t0
    if on_done is not None:
        on_done(c)
    return c


async def _run(base_url: str, n_requests: int, concurrency: int, prompt_words: int,
               max_tokens: int, traced_every: int, seed: int, salt: str,
               timeout_s: float, on_done: Callable[[Completion], None] | None) -> LoadResult:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout_s,
                         max_retries=0)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    try:
        done = await asyncio.gather(*(
            _one(client, "tiny", i, corpus(prompt_words, seed * 100_003 + i), max_tokens,
                 traced_every > 0 and i % traced_every == 0, salt, sem, on_done)
            for i in range(n_requests)))
    finally:
        await client.close()
    return LoadResult(completions=list(done), wall_s=time.perf_counter() - t0)


def run_load(base_url: str, n_requests: int = 16, concurrency: int | None = None,
             prompt_words: int = 100, max_tokens: int = 96, traced_every: int = 4,
             seed: int = 0, salt: str = "kvobs", timeout_s: float = 300.0,
             on_done: Callable[[Completion], None] | None = None) -> LoadResult:
    """Send ``n_requests`` streamed completions, ``concurrency`` at a time
    (default: all at once); every ``traced_every``-th carries a traceparent.
    ``on_done`` is called (in the client's event loop) as each one ends."""
    return asyncio.run(_run(base_url, n_requests, concurrency or n_requests, prompt_words,
                            max_tokens, traced_every, seed, salt, timeout_s, on_done))
