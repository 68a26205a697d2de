"""``LLMEngine``: add requests, ``step()`` them forward (schedule → run → sample → update).

The engine owns the request lifecycle and wires its parts: the input processor at the door (clear
errors, nothing admitted that cannot finish), the scheduler, the model runner and the sampler for
the step, the output processor after it (detokenisation, stop conditions, outputs), and every KV
block returned when a request finishes or is aborted. What it serves is decided before it starts:
the model (``models.model_dir``), the dtypes (``platforms.dtypes``) and the ranks' plan
(``parallel.rank_plan``). It is single-threaded; ``AsyncEngine`` drives it for the server.

A request with a structured-output constraint gets its own grammar state at ``add_request``; each
step, ``grammar_masks`` computes the allowed tokens of the constrained requests about to sample
(during the forward), the sampler applies them, and each chosen token advances its request's
grammar; a grammar that is complete ends its request with ``stop``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.adapters import EngineAdapters
from kunlun_runtime.engine.grammar_masks import GrammarMasks, PendingMasks, advance_grammar
from kunlun_runtime.engine.input_processor import InputProcessor, PromptInput
from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.model_runner import ModelRunner, StepLogits
from kunlun_runtime.engine.output_processor import OutputProcessor, RequestState
from kunlun_runtime.engine.outputs import EngineCounters, RequestOutput
from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.engine.sampler import Sampler, make_logprob
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.scheduler import Scheduler, SchedulerLimits
from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.engine.spec_decode import SpeculativeDecoder
from kunlun_runtime.errors import ConfigError, InvalidRequestError
from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.event_publisher import KVEventPublisher
from kunlun_runtime.kv.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared
from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.kv.prefix_hash import PrefixHasher
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.kernel_choice import choose_for_config
from kunlun_runtime.layers.runtime_info import RuntimeInfo, announce_start
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.lora.slots import install_adapter
from kunlun_runtime.models.model_config import ModelConfig, load_model_config
from kunlun_runtime.models.model_dir import resolve_max_model_len, resolve_model_dir, served_model_name
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.parallel.rank_plan import plan_ranks
from kunlun_runtime.parallel.workers import LeaderGroup, build_rank
from kunlun_runtime.platforms import detect
from kunlun_runtime.platforms.dtypes import resolve_dtype, resolve_weight_dtype
from kunlun_runtime.structured.grammar import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        self.platform = detect(config.device)
        self.device = self.platform.device()
        self.dtype = resolve_dtype(config.dtype, self.platform)  # activations
        self.weight_dtype = resolve_weight_dtype(config.dtype, self.platform)
        self.model_dir = resolve_model_dir(config.model)
        model_config = load_model_config(self.model_dir)
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.model_config = model_config
        self.tokenizer = Tokenizer(self.model_dir)  # before any worker starts: fail fast, leak nothing
        self.group: LeaderGroup | None = None
        # Its sockets bound before the model loads: a busy or wrong endpoint fails fast.
        self.kv_events = self._open_kv_events()
        try:
            self._load(config, model_config)
        except BaseException:
            self.close()  # the publisher's sockets, the other ranks
            raise
        if self.kv_events is not None:
            self.kv_events.start()

    def _load(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """Plan and load the ranks, then build what steps them (the scheduler, runner, sampler, ...)."""
        rank_spec = plan_ranks(config, self.platform, model_config, self.model_dir, self.max_model_len)
        self.kv_cache_dtype = rank_spec.cache_dtype  # what the paged KV cache stores
        num_blocks = rank_spec.num_blocks
        if config.node_rank != 0:
            raise ConfigError(
                f"node_rank: {config.node_rank} follows the leader (run_worker_node); only node 0 runs the engine",
                field="node_rank",
            )
        if rank_spec.layout.world > 1:
            self.group = LeaderGroup(rank_spec)
            self.model, self.kv_cache, _ = self.group.start()  # closes the group if it fails
        else:
            self.model, self.kv_cache, _ = build_rank(rank_spec, 0)
        self.served_model_name = served_model_name(config)
        events = config.kv_events_config
        self.block_pool = BlockPool(num_blocks, record_events=events is not None and events.publishes)
        self.num_kv_blocks = num_blocks
        self.num_kv_tokens = num_blocks * config.block_size  # KV capacity, in tokens, of the whole pool
        hasher = PrefixHasher.create(config.prefix_caching_hash_algo, os.environ.get("PYTHONHASHSEED"))
        self.kv = KVManager(self.block_pool, config.block_size, config.enable_prefix_caching, hasher)
        self.scheduler = Scheduler(
            SchedulerLimits.from_config(config),
            self.kv,
            utilization=self._utilization_reader(),
            pass_rows=self.model.decode_pass_rows,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, group=self.group)
        self.adapters: EngineAdapters | None = None
        if config.enable_lora:
            self.adapters = EngineAdapters(
                config, model_config, self.served_model_name, self._install_lora, self.model.activation_dtype
            )
        self.eos_token_ids = model_config.eos_token_ids
        # Greedy picks through our argmax where the model runs our kernels: the same results as
        # torch.argmax, whose generic reduction runs far below memory bandwidth over a large vocabulary.
        argmax = cpu_kernels.argmax_rows if self.model.native_kernels else None
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, argmax=argmax)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_config is not None:
            self.spec = SpeculativeDecoder(config.speculative_config, self.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, model_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.structured = GrammarCompiler(
            (self.model_dir / "tokenizer.json").read_text(), model_config.vocab_size, self.eos_token_ids
        )
        self.overlap_masks = True  # compute masks during the forward (False: in line, for comparison)
        self.masks = GrammarMasks(self.structured)
        self._tracked: dict[str, RequestState] = {}
        self.num_generation_tokens_total = 0
        self.num_prompt_tokens_total = 0
        # What the start line, /version and kunlun:runtime_info say (the kernels: plan_ranks' choice).
        self.runtime_info = RuntimeInfo(
            device=str(self.device),
            kernels=choose_for_config(config, self.dtype, self.weight_dtype, self.device),
            dtype=self.dtype,
            weight_dtype=self.weight_dtype,
            quantization=config.quantization,
            kv_dtype=self.kv_cache_dtype,
            num_kv_tokens=self.num_kv_tokens,
        )
        announce_start(
            self.runtime_info,
            model=self.model_dir,
            max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache.nbytes,
        )

    def _open_kv_events(self) -> KVEventPublisher | None:
        """The KV event publisher, one per engine (the leader's; no other rank has a KV manager),
        its sockets bound (its thread starts once the engine is built), announcing an empty cache
        first: an indexer drops what a previous run of this pod left."""
        events = self.config.kv_events_config
        if events is None or not events.publishes:
            return None
        # vLLM's names for where the blocks live: host memory on the CPU, the accelerator's otherwise.
        medium = MEDIUM_CPU if self.platform.device_type == "cpu" else MEDIUM_GPU
        publisher = KVEventPublisher(events, medium=medium, encoding=self.config.kv_events_encoding)
        publisher.publish([AllBlocksCleared()])
        return publisher

    def _utilization_reader(self) -> Callable[[], float | None] | None:
        """Device utilisation for the feedback policy, read at most once a second (xpu-smi is a
        subprocess). None on CPU: psutil reports the whole machine, not this engine's device."""
        if self.platform.device_type == "cpu":
            return None
        cached: list[float] = [0.0, 0.0]  # (read at, value)

        def read() -> float | None:
            now = time.monotonic()
            if now - cached[0] >= 1.0:
                cached[:] = [now, self.platform.telemetry().utilization_ratio or 0.0]
            return cached[1]

        return read

    def close(self) -> None:
        """Send the last KV events and stop the other ranks (no-op on one rank)."""
        publisher = getattr(self, "kv_events", None)
        if publisher is not None:
            if hasattr(self, "block_pool"):  # not on an engine whose load failed
                self._publish_kv_events()
            publisher.close()
            self.kv_events = None
        if self.group is not None:
            self.group.close()
            self.group = None
        masks = getattr(self, "masks", None)  # close() also runs on a half-built engine
        if masks is not None:
            masks.close()

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        lora_adapter: LoRAAdapter | None = None,
        register_lora: bool = True,
    ) -> Request:
        """Validate and queue a request (on the LoRA adapter ``lora_request``: its weights
        ``lora_adapter`` where read already, off the engine thread; a new adapter is registered
        now unless ``register_lora`` is False, when it is a 404). Raises InvalidRequestError
        naming the field."""
        if request_id in self._tracked:
            raise InvalidRequestError(f"request_id: {request_id!r} is already running", field="request_id")
        prompt_text, request = self.input_processor.make_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt, arrival_time=arrival_time
        )
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.new_matcher(params.structured_outputs)
        if lora_request is not None:  # last: a refusal above must leave no weights pinned
            request.lora = self._lora_adapters().pin(
                request_id, lora_request, lora_adapter, register=register_lora
            )
        self._tracked[request_id] = self.output_processor.new_state(request, prompt_text, grammar)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and return its blocks; None if it is unknown or already done."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        return self._finish(tracked, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def waiting_request_ids(self) -> list[str]:
        """The requests waiting to be admitted to a step, in the scheduler's order."""
        return [request.request_id for request in self.scheduler.waiting]

    def counters(self) -> EngineCounters:
        """The queue sizes and running totals now, for metrics (see ``EngineCounters``)."""
        return EngineCounters(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage_ratio=self.block_pool.usage_ratio,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_prefix_queries=self.kv.num_prefix_queries,
            num_prefix_hits=self.kv.num_prefix_hits,
            structured_mask_seconds_total=self.structured.mask_seconds_total,
            structured_requests_total=tuple(self.structured.requests_total.items()),
            num_kv_event_batches_dropped=0 if self.kv_events is None else self.kv_events.num_dropped,
            spec_decode=None if self.spec is None else self.spec.counters.totals(),
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after the weights changed), as vLLM's: only while no
        request holds blocks (False, nothing changed, otherwise), so that no block cached later
        names a parent the indexers were told is gone. Publishes ``AllBlocksCleared``."""
        if self.block_pool.num_free < self.block_pool.num_blocks:
            return False
        self.block_pool.reset_prefix_cache()
        self._publish_kv_events()
        return True

    def _publish_kv_events(self) -> None:
        """Hand what the block pool recorded to the publisher: one batch per step, if any."""
        if self.kv_events is not None:
            self.kv_events.publish(self.block_pool.drain_events())

    # -- LoRA adapters --------------------------------------------------------------------------
    def _lora_adapters(self) -> EngineAdapters:
        if self.adapters is None:
            raise InvalidRequestError(
                "lora_request: LoRA is not enabled (--enable-lora)", field="lora_request"
            )
        return self.adapters

    def read_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter's checkpoint (thread-safe: for callers off the engine thread)."""
        return self._lora_adapters().read(lora)

    def add_lora(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Register an adapter (read here unless ``adapter`` was read already)."""
        self._lora_adapters().add(lora, adapter)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter (False: unknown); requests running on it finish on it."""
        return self._lora_adapters().registry.remove(lora_name)

    def lora_is_loaded(self, lora: LoRARequest) -> bool:
        """Whether a request on ``lora`` needs no checkpoint read (thread-safe enough: a stale
        answer only moves a read to the engine thread)."""
        return self.adapters is not None and self.adapters.is_loaded(lora)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.adapters is None else self.adapters.registry.known()

    def lora_activity(self) -> tuple[int, list[str], list[str]]:
        """(max_loras, adapters of running requests, adapters of waiting ones)."""
        return self._lora_adapters().activity(self.scheduler.running, self.scheduler.waiting)

    def _install_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        if self.group is not None:
            self.group.install_lora(slot, adapter)
        else:
            install_adapter(self.model, slot, adapter)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that progressed or finished.
        The KV events the step caused (blocks cached, evicted) leave as one batch after it."""
        if self.spec is not None:
            self.spec.propose(
                self.scheduler.running, self.model.decode_max_rows, self.scheduler.cost, self._grammar_of
            )
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._publish_kv_events()
            return []
        began = self._start_step(sched)
        masks = self.masks.start(sched, self._grammar_of, overlap=self.overlap_masks)
        lora_slots = (
            None if self.adapters is None else self.adapters.assign_slots(sched, self.scheduler.running)
        )
        logits = self.runner.execute(sched, self._block_tables(sched), lora_slots)
        sampled = self._finish_step(sched, logits, began, masks)
        now = time.monotonic()
        outputs = []
        for tracked, tokens in sampled:
            for index, (token_id, logprob) in enumerate(tokens):
                outputs.append(self._append_token(tracked, token_id, logprob, now))
                if tracked.request.is_finished:
                    break
                if index < len(tokens) - 1:  # an accepted draft: its KV was computed this step
                    tracked.request.num_computed_tokens += 1
            if len(tokens) > 1 and not tracked.request.is_finished:
                self.kv.cache_computed_blocks(tracked.request)
        for item in sched.scheduled:  # rejected drafts give back the blocks made for them
            request = item.request
            if item.num_draft_tokens and not request.is_finished and not request.protected:
                self.kv.release_beyond(request, request.num_tokens)
        self._publish_kv_events()
        return outputs

    def _start_step(self, sched: SchedulerOutput) -> float:
        """Stamp the scheduled requests; returns the step's start (for the step-time model)."""
        now = time.monotonic()
        for item in sched.scheduled:
            times = self._tracked[item.request.request_id].times
            times.scheduled = times.scheduled or now
        return now

    def _grammar_of(self, request_id: str) -> GrammarMatcher | None:
        return self._tracked[request_id].grammar

    def _block_tables(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        return {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled}

    def _finish_step(
        self, sched: SchedulerOutput, logits: StepLogits, began: float, masks: PendingMasks | None
    ) -> list[tuple[RequestState, list[tuple[int, TokenLogprob | None]]]]:
        """After the forward: let the scheduler account for the step, record prompt logprobs, and
        sample (verifying drafts); returns each request's new tokens (id, logprob)."""
        seconds = time.monotonic() - began
        self.scheduler.update_from_output(sched, seconds)
        if self.spec is not None:
            self.spec.observe(sched, seconds)
        for request_id, (first_pos, rows) in logits.prompt_logits.items():
            self._record_prompt_logprobs(self._tracked[request_id].request, first_pos, rows)
        tracked = [self._tracked[rid] for rid in logits.sample_request_ids]
        if not tracked:
            return []
        allowed = None if masks is None else masks.result()
        requests = [t.request for t in tracked]
        if self.spec is not None:
            tokens = self.spec.sample(
                self.sampler, logits.sample_logits, logits.sample_counts, requests, allowed
            )
            return list(zip(tracked, tokens, strict=True))
        sampled = self.sampler.sample(logits.sample_logits, requests, allowed)
        return [(t, [result]) for t, result in zip(tracked, sampled, strict=True)]

    def _record_prompt_logprobs(self, request: Request, first_pos: int, rows: torch.Tensor) -> None:
        num_top = request.params.prompt_logprobs
        assert num_top is not None  # the runner returns prompt logits only to requests that want them
        logprobs = torch.log_softmax(rows, dim=-1)
        if first_pos == 0:
            request.prompt_logprobs.append(None)
        for offset in range(rows.shape[0]):
            next_token = request.prompt_token_ids[first_pos + offset + 1]
            request.prompt_logprobs.append(make_logprob(logprobs[offset], next_token, num_top))

    def _append_token(
        self, tracked: RequestState, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        self._record_token(tracked, token_id, logprob, now)
        return self._emit(tracked, token_id)

    def _record_token(
        self, tracked: RequestState, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> None:
        """The new token's id, logprob and times: all the next step's schedule needs."""
        request = tracked.request
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        self.num_generation_tokens_total += 1
        if tracked.grammar is not None:  # before the next schedule: its mask needs the new state
            tracked.grammar_end = advance_grammar(tracked.grammar, token_id)
        if tracked.times.first_token is None:
            tracked.times.first_token = now
            self.num_prompt_tokens_total += len(request.prompt_token_ids)
        tracked.times.last_token = now

    def _emit(self, tracked: RequestState, token_id: int) -> RequestOutput:
        """Detokenize the recorded token, check the stop conditions, and build the output."""
        status = self.output_processor.process_token(tracked, token_id)
        if status is not None:
            return self._finish(tracked, status, new_token_ids=[token_id])
        return self.output_processor.make_output(tracked, new_token_ids=[token_id])

    def _finish(
        self, tracked: RequestState, status: RequestStatus, new_token_ids: Sequence[int] = ()
    ) -> RequestOutput:
        """End a request: return its blocks and its sampler state, then build its final output."""
        request = tracked.request
        self.scheduler.finish(request, status)
        self.sampler.forget(request.request_id)
        if self.spec is not None:
            self.spec.forget(request)
        if self.adapters is not None:
            self.adapters.release(request.request_id)
        del self._tracked[request.request_id]
        return self.output_processor.finish(tracked, status, new_token_ids)
