"""One rank's model runner, minus the model.

``RankRunner`` holds the worker-role KV connector that vLLM's real
``KVConnectorFactory`` builds from ``kv_transfer_config`` (so whatever class
is named there, stock or instrumented, is the one exercised), the rank's KV
cache tensors laid out by vLLM's own ``allocate_kv_cache`` (LBHNC, on CPU),
and per step drives the connector in the order vLLM's runners do:

* ``v2`` (vLLM's default runner, the only one in 0.34,
  ``vllm/v1/worker/gpu/model_runner.py``):
  vLLM's real ``ActiveKVConnector`` does the connector calls
  (``pre_forward``: handle_preemptions, bind metadata, sync loads;
  ``finish_forward``; ``post_forward``: async ``start_load_kv`` with the
  input-batch kwargs, ``wait_for_save``, ``get_transfer_results``, worker
  meta, clear; ``no_forward`` for 0-token steps, where ``start_load_kv`` gets
  no ``request_ids`` keyword).
* ``v1`` (``vllm/v1/worker/gpu_model_runner.py``, vLLM 0.32/0.33): ``handle_preemptions``
  first, then vLLM's real ``KVConnectorModelRunnerMixin`` context
  (``_get_kv_connector_output`` inside ``set_forward_context(attn_metadata)``)
  or ``kv_connector_no_forward`` (forward context with no attention metadata).

Sampling follows the scheduler as vLLM's runners do: V2 samples once the
scheduled positions reach the tokens it was handed at admission
(``prefill_len``) and puts the token at the next position; V1 first trims the
output tokens the scheduler no longer counts (``num_output_tokens``). A token
the scheduler discarded (a failed sync load under the "recompute" policy) is
therefore dropped here too, instead of stalling the request.

The "forward" writes fabricated KV bytes for every scheduled token through
vLLM's real per-layer hook (``maybe_transfer_kv_layer``: wait_for_layer_load /
save_kv_layer), and checks, whenever a request (re)enters the batch with
already-computed tokens (prefix-cache hit or CPU restore), that its KV blocks
hold exactly the bytes the model would have written.

vLLM looks the worker connector up through a process-global
(``kv_transfer_state._KV_CONNECTOR_AGENT``). Several inline ranks share one
process, so each rank installs its connector there only while it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvobs_otel.tools.harness import compat
from kvobs_otel.tools.harness.config import TinyLlama, offloading_part
from kvobs_otel.tools.harness.fabricate import KVFabricator, PrefixHashes, sampled_token

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput


class KVIntegrityError(AssertionError):
    """A request's KV blocks do not hold the bytes its tokens imply."""


@dataclass
class HarnessAttnMetadata:
    """Just enough attention metadata for connectors that look at it."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    req_ids: list[str]


@dataclass
class _InputBatch:
    """The fields of the V2 runner's InputBatch that ActiveKVConnector reads."""

    req_ids: list[str]
    idx_mapping: torch.Tensor
    num_tokens: int


@dataclass
class _ReqState:
    # Every token of the sequence as this rank knows it (KV bytes derive from
    # them); the newest sampled one has no KV yet.
    tokens: list[int]
    block_ids: list[int]
    # The scheduler's computed-token count (positions come from it).
    num_computed: int
    # Tokens handed over at admission: the prompt, plus the tokens generated
    # before a preemption when the request resumes (V2's prefill_len).
    prefill_len: int
    # Prompt tokens (V1 aligns its output tokens past them).
    prompt_len: int
    hashes: PrefixHashes = field(default_factory=PrefixHashes)
    # Entered the batch this step with computed tokens it did not compute here.
    needs_check: bool = False


@dataclass
class RunnerStats:
    steps: int = 0
    forward_steps: int = 0
    no_forward_steps: int = 0
    # Requests entering the batch: new (V2: also resumed) / V1 resumed.
    new_requests: int = 0
    resumed_requests: int = 0
    tokens_written: int = 0
    kv_checked_tokens: int = 0
    kv_checked_requests: int = 0


class _FakeAttention:
    """Registered in static_forward_context like a real Attention layer."""

    def __init__(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        self.layer_name = layer_name
        self.kv_cache = kv_cache


def _make_layer_call() -> Any:
    from vllm.model_executor.layers.attention.kv_transfer_utils import (
        maybe_transfer_kv_layer,
    )

    # vLLM's own decorator around attention: wait_for_layer_load on entry,
    # save_kv_layer on exit, when a connector and attn metadata are present.
    @maybe_transfer_kv_layer
    def attention_layer(layer_name: str, write: Any) -> None:
        write(layer_name)

    return attention_layer


class RankRunner:
    """Model-runner emulation for one rank (see module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        model: TinyLlama,
        rank: int,
        mode: str = "v2",
        seed: int = 0,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.plugins import load_general_plugins
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        compat.check_model_runner(mode)
        assert vllm_config.parallel_config.rank == rank
        # What WorkerWrapperBase does in every vLLM worker process.
        load_general_plugins()
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.model = model
        self.rank = rank
        self.mode = mode
        self.seed = seed
        self.stats = RunnerStats()
        self.requests: dict[str, _ReqState] = {}
        assert len(kv_cache_config.kv_cache_groups) == 1, "one KV cache group"
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size: int = spec.block_size
        self.layer_names: list[str] = list(kv_cache_config.kv_cache_groups[0].layer_names)

        self.connector = KVConnectorFactory.create_connector(
            config=vllm_config,
            role=KVConnectorRole.WORKER,
            kv_cache_config=kv_cache_config,
        )
        layout = KVCacheLayout[vllm_config.cache_config.kv_cache_layout]
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), layout
        )
        # Byte views [B, H, N, C] of every layer, for writing/checking tokens.
        self._kv_bytes = {n: t.view(torch.int8) for n, t in self.kv_caches.items()}
        first = self._kv_bytes[self.layer_names[0]]
        self.fabricator = KVFabricator(rank, first.shape[1], first.shape[3])
        static_ctx = vllm_config.compilation_config.static_forward_context
        for name, tensor in self.kv_caches.items():
            static_ctx[name] = _FakeAttention(name, tensor)
        self._attention_layer = _make_layer_call()
        # A companion connector in a MultiConnector (companion.py) serves
        # what it claims with this rank's true KV, as a real source would.
        for c in getattr(self.connector, "_connectors", None) or ():
            if hasattr(c, "fill_true_kv"):
                c.fill_true_kv = self._write_served

        with self.installed():
            if mode == "v2":
                from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                # Its __init__ registers the KV caches with the connector found
                # through get_kv_transfer_group(), as in GPUModelRunner V2.
                self.kv = ActiveKVConnector(vllm_config, self.kv_caches)
            else:
                # GPUModelRunner (V1).initialize_kv_cache does the same.
                self.connector.register_kv_caches(self.kv_caches)
                self.connector.set_host_xfer_buffer_ops(copy_kv_blocks)

    # -- process-global connector --------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Make this rank's connector vLLM's global worker connector."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        prev = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = prev

    @property
    def offloading_worker(self) -> Any:
        """The OffloadingWorker the connector's spec created, if reachable."""
        cw = getattr(offloading_part(self.connector), "connector_worker", None)
        return getattr(cw, "worker", None)

    # -- one step -------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """execute_model + sample_tokens for one scheduler step."""
        self.stats.steps += 1
        with self.installed(), torch.inference_mode():
            if self.mode == "v2":
                return self._execute_v2(scheduler_output)
            return self._execute_v1(scheduler_output)

    def _execute_v2(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.forward_context import set_forward_context

        self._update_states(so, v2=True)
        self._zero_new_blocks(so)
        if so.total_num_scheduled_tokens == 0:
            self.stats.no_forward_steps += 1
            return self.kv.no_forward(so)
        req_ids = list(so.num_scheduled_tokens)
        batch = _InputBatch(
            req_ids=req_ids,
            idx_mapping=torch.arange(len(req_ids), dtype=torch.int32),
            num_tokens=so.total_num_scheduled_tokens,
        )
        attn_metadata, slot_mappings = self._attn_metadata(so)
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=so.total_num_scheduled_tokens,
            slot_mapping=slot_mappings,
        ):
            self.kv.pre_forward(so, batch)
            self._forward(so)
        self.kv.finish_forward()
        # sample_tokens()
        output = self._sample(so)
        output.kv_connector_output = self.kv.post_forward(so.finished_req_ids)
        return output

    def _execute_v1(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin as Mixin,
        )

        assert so.kv_connector_metadata is not None
        self.connector.handle_preemptions(so.kv_connector_metadata)
        self._update_states(so, v2=False)
        self._zero_new_blocks(so)
        if so.total_num_scheduled_tokens == 0:
            self.stats.no_forward_steps += 1
            return Mixin.kv_connector_no_forward(so, self.vllm_config)
        attn_metadata, slot_mappings = self._attn_metadata(so)
        with (
            set_forward_context(
                attn_metadata,
                self.vllm_config,
                num_tokens=so.total_num_scheduled_tokens,
                slot_mapping=slot_mappings,
            ),
            Mixin.maybe_get_kv_connector_output(so) as kv_connector_output,
        ):
            self._forward(so)
        output = self._sample(so)
        output.kv_connector_output = kv_connector_output
        return output

    # -- request state (the runner's persistent batch) ----------------------

    def _update_states(self, so: SchedulerOutput, v2: bool) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if v2:
            # The V2 runner frees preempted requests like finished ones.
            for req_id in so.preempted_req_ids or ():
                self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.stats.new_requests += 1
            # V2 (v1/worker/gpu/model_runner.py add_requests) replaces any
            # state with prefill_token_ids: the scheduler's whole sequence, so
            # a resumed request drops whatever this rank had sampled past it.
            tokens = new.prefill_token_ids if v2 else new.prompt_token_ids
            assert tokens is not None
            prompt_len = len(new.prompt_token_ids or ()) or len(tokens)
            self.requests[new.req_id] = _ReqState(
                tokens=list(tokens),
                block_ids=list(new.block_ids[0]),
                num_computed=new.num_computed_tokens,
                prefill_len=len(tokens),
                prompt_len=prompt_len,
                needs_check=new.num_computed_tokens > 0,
            )
        cached = so.scheduled_cached_reqs
        resumed_ids = compat.resumed_req_ids(cached)
        all_token_ids = compat.cached_all_token_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in resumed_ids
            if state is None or resumed:
                self.stats.resumed_requests += 1
                tokens = all_token_ids.get(req_id)
                if tokens is None and state is not None:
                    tokens = state.tokens
                assert tokens is not None, f"no tokens known for {req_id}"
                prompt_len = state.prompt_len if state is not None else len(tokens)
                state = _ReqState(
                    tokens=list(tokens),
                    block_ids=[],
                    num_computed=0,
                    prefill_len=len(tokens),
                    prompt_len=prompt_len,
                )
                self.requests[req_id] = state
                state.block_ids = list(new_blocks[0]) if new_blocks else []
                state.needs_check = cached.num_computed_tokens[i] > 0
            else:
                if req_id in all_token_ids:
                    state.tokens = list(all_token_ids[req_id])
                if new_blocks:
                    state.block_ids.extend(new_blocks[0])
            if not v2:
                self._align_v1_outputs(state, cached.num_output_tokens[i])
            state.num_computed = cached.num_computed_tokens[i]

    @staticmethod
    def _align_v1_outputs(state: _ReqState, num_output_tokens: int) -> None:
        """V1 (v1/worker/gpu_model_runner.py ``_update_states``): output
        tokens the scheduler discarded (its ``num_output_tokens`` is smaller
        than the runner's) are deleted from the cached state."""
        keep = state.prompt_len + num_output_tokens
        if keep < len(state.tokens):
            del state.tokens[keep:]

    def _zero_new_blocks(self, so: SchedulerOutput) -> None:
        # Both runners zero freshly allocated blocks before the step's loads.
        if not so.new_block_ids_to_zero:
            return
        idx = torch.tensor(so.new_block_ids_to_zero, dtype=torch.long)
        for view in self._kv_bytes.values():
            view[idx] = 0

    # -- the fake forward --------------------------------------------------

    def _positions(self, req_id: str, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.requests[req_id]
        pos = np.arange(start, start + n)
        block_idx = pos // self.block_size
        if len(block_idx) and block_idx[-1] >= len(state.block_ids):
            raise RuntimeError(
                f"rank {self.rank}: {req_id} has {len(state.block_ids)} blocks, "
                f"needs {block_idx[-1] + 1}"
            )
        blocks = np.asarray(state.block_ids, dtype=np.int64)[block_idx]
        return torch.from_numpy(blocks), torch.from_numpy(pos % self.block_size)

    def _attn_metadata(
        self, so: SchedulerOutput
    ) -> tuple[dict[str, HarnessAttnMetadata], dict[str, torch.Tensor]]:
        slots: list[torch.Tensor] = []
        seq_lens: list[int] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            blocks, offs = self._positions(req_id, state.num_computed, n)
            slots.append(blocks * self.block_size + offs)
            seq_lens.append(state.num_computed + n)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        meta = HarnessAttnMetadata(
            num_actual_tokens=so.total_num_scheduled_tokens,
            slot_mapping=slot_mapping,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            req_ids=list(so.num_scheduled_tokens),
        )
        names = self.layer_names
        return {n: meta for n in names}, {n: slot_mapping for n in names}

    def _forward(self, so: SchedulerOutput) -> None:
        self.stats.forward_steps += 1
        for layer_idx, layer_name in enumerate(self.layer_names):

            def layer(name: str, layer_idx: int = layer_idx) -> None:
                self._write_layer(so, name, layer_idx)
                # Attention reads after the batch's KV writes (the cache
                # update precedes the kernel), so a request sharing blocks
                # with another one in the same batch sees them filled.
                self._check_entered(so, layer_idx)

            self._attention_layer(layer_name, layer)
        for req_id in so.num_scheduled_tokens:
            state = self.requests[req_id]
            if state.needs_check:
                state.needs_check = False
                self.stats.kv_checked_requests += 1
                self.stats.kv_checked_tokens += state.num_computed

    def _write_layer(self, so: SchedulerOutput, layer_name: str, layer_idx: int) -> None:
        view = self._kv_bytes[layer_name]
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed + n
            if end > len(state.tokens):
                raise RuntimeError(
                    f"rank {self.rank}: {req_id} scheduled up to {end} tokens "
                    f"but only {len(state.tokens)} are known"
                )
            hashes = state.hashes.upto(state.tokens, end)[state.num_computed : end]
            blocks, offs = self._positions(req_id, state.num_computed, n)
            data = self.fabricator.tokens_bytes(hashes, layer_idx)
            view[blocks, :, offs, :] = torch.from_numpy(data)
            if layer_idx == 0:
                self.stats.tokens_written += n

    def _write_served(self, req_id: str, num_tokens: int) -> None:
        """The KV of the ``num_tokens`` tokens another connector just brought
        to ``req_id`` (the last of its computed tokens), in every layer."""
        state = self.requests[req_id]
        start = state.num_computed - num_tokens
        hashes = state.hashes.upto(state.tokens, state.num_computed)[start:]
        blocks, offs = self._positions(req_id, start, num_tokens)
        for layer_idx, layer_name in enumerate(self.layer_names):
            data = self.fabricator.tokens_bytes(hashes, layer_idx)
            self._kv_bytes[layer_name][blocks, :, offs, :] = torch.from_numpy(data)

    def _check_entered(self, so: SchedulerOutput, layer_idx: int) -> None:
        # Requests whose KV came from elsewhere (prefix cache, CPU restore)
        # must hold exactly the model's bytes when attention reads them.
        for req_id in so.num_scheduled_tokens:
            state = self.requests[req_id]
            if state.needs_check:
                self._check_layer(req_id, state.num_computed, layer_idx)

    def check_request_kv(self, req_id: str, num_tokens: int) -> int:
        """Compare the first ``num_tokens`` tokens' KV with the expected bytes."""
        for layer_idx in range(len(self.layer_names)):
            self._check_layer(req_id, num_tokens, layer_idx)
        return num_tokens

    def _check_layer(self, req_id: str, num_tokens: int, layer_idx: int) -> None:
        if num_tokens == 0:
            return
        state = self.requests[req_id]
        layer_name = self.layer_names[layer_idx]
        hashes = state.hashes.upto(state.tokens, num_tokens)
        blocks, offs = self._positions(req_id, 0, num_tokens)
        got = self._kv_bytes[layer_name][blocks, :, offs, :].numpy()
        want = self.fabricator.tokens_bytes(hashes, layer_idx)
        if not np.array_equal(got, want):
            bad = np.nonzero((got != want).reshape(num_tokens, -1).any(axis=1))[0]
            raise KVIntegrityError(
                f"rank {self.rank}: {req_id} layer {layer_name}: KV of "
                f"{len(bad)} of {num_tokens} tokens differs (first at "
                f"position {int(bad[0])}, block {int(blocks[bad[0]])})"
            )

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        vocab = self.model.vocab_size
        for req_id in req_ids:
            state = self.requests[req_id]
            state.num_computed += so.num_scheduled_tokens[req_id]
            # seq_len: the positions the scheduler had computed, this step's
            # included. Whether to sample is decided from it, as vLLM does,
            # never from how many tokens this rank happens to hold.
            seq_len = state.num_computed
            if self._samples(state, seq_len):
                # The token sampled at seq_len. Tokens this rank held past it
                # were discarded by the scheduler (under the "recompute" load
                # failure policy, scheduler.py _handle_invalid_blocks rewinds
                # a request whose sync load failed and update_from_output
                # drops the token it sampled). V2 feeds its next step the last
                # sampled token at position num_computed_tokens (input_batch.py
                # combine_sampled_and_draft_tokens): they never count there.
                del state.tokens[seq_len:]
                tok = sampled_token(self.seed, req_id, seq_len, vocab)
                state.tokens.append(tok)
                sampled.append([tok])
            else:
                # A partial prefill chunk samples nothing.
                sampled.append([])
        return compat.model_runner_output(req_ids, sampled)

    def _samples(self, state: _ReqState, seq_len: int) -> bool:
        if self.mode == "v2":
            # V2 (v1/worker/gpu/input_batch.py get_num_sampled_and_rejected):
            # a chunk ending before prefill_len is a chunked prefill.
            return seq_len >= state.prefill_len
        # V1 (v1/worker/gpu_model_runner.py discard_request_mask): discard
        # while the scheduled positions end before the request's tokens.
        return seq_len >= len(state.tokens)

    # -- teardown -----------------------------------------------------------

    def shutdown(self) -> None:
        """Connector shutdown, as vLLM's worker does at exit."""
        with self.installed():
            self.connector.shutdown()
