"""LLMEngine: the request-at-a-time interface that `LLM` and the worker servers drive.

    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="")

Single-threaded by design: one loop thread owns the engine and calls every method. A prompt becomes
a `Request` in `input_processor.py`; sampled tokens become request state and outputs in
`output_processor.py`, which plain and speculative steps share.

For disaggregated serving:
  * prefill side: `add_request(..., prefill_only=True)` runs the prompt and samples the first
    token; the request finishes with reason "prefilled" and its blocks stay pinned (readable
    through `block_ids`) until `release(request_id)`.
  * decode side: `reserve(request_id, prompt_ids, params)` holds blocks for K/V that
    another worker writes into `kv_cache` (sharing the leading blocks its own prefix cache
    holds, which the writer skips); `commit_remote_prefill(request_id, first_token)`
    then starts decoding as if the prompt had been prefilled here; `abort` frees them.
  * `step(layer_hook=...)` passes a per-layer callback to prefill steps so a transfer can
    start on layer i while later layers still compute; `scheduled` tells it which blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch

from disagg.kernels import native_build
from disagg.worker.engine import prompt_logprobs
from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.batch_builder import build_batch
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import BlockManager
from disagg.worker.engine.input_processor import InputProcessor
from disagg.worker.engine.output_processor import OutputProcessor
from disagg.worker.engine.outputs import RequestOutput, TokenLogprob
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.engine.resume import Resumption
from disagg.worker.engine.sampler import Sampler
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.scheduler import Scheduler, SchedulerOutput
from disagg.worker.engine.speculative.config import SpeculativeConfig
from disagg.worker.engine.speculative.speculator import Speculator, make_proposer
from disagg.worker.engine.tiers.tiers import KVTiers
from disagg.worker.model.runner import ModelRunner, plan_num_blocks


class Reservation(list):
    """The block ids reserved for a remotely prefilled prompt, in sequence order (a plain list to
    callers that only want the ids), and how many leading ones the prefix cache already holds."""

    def __init__(self, block_ids: Sequence[int], num_cached_blocks: int):
        super().__init__(block_ids)
        if not 0 <= num_cached_blocks < max(len(self), 1):
            raise ValueError(f"num_cached_blocks must be in [0, {len(self)}), got {num_cached_blocks}")
        self.num_cached_blocks = num_cached_blocks

    @property
    def fresh_block_ids(self) -> list[int]:
        """The blocks the remote prefill must write."""
        return list(self[self.num_cached_blocks :])


def engine_args(model: str | Path | EngineArgs, settings: dict) -> EngineArgs:
    """An `EngineArgs` from a model path and keyword settings (torch dtypes and devices accepted
    as well as their names), or the given one unchanged when no settings override it."""
    if isinstance(model, EngineArgs):
        if settings:
            return dataclasses.replace(model, **_names(settings))
        return model
    return EngineArgs(model=str(model), **_names(settings))


def _names(settings: dict) -> dict:
    out = dict(settings)
    if isinstance(out.get("dtype"), torch.dtype):
        out["dtype"] = str(out["dtype"]).removeprefix("torch.")
    if isinstance(out.get("device"), torch.device):
        out["device"] = str(out["device"])
    return out


class LLMEngine:
    def __init__(self, model: str | Path | EngineArgs, *, load_tokenizer: bool = True,
                 rank_authkey: bytes | None = None, **settings):  # fmt: skip
        """`LLMEngine(path, block_size=32, ...)` or `LLMEngine(EngineArgs(...))`: the settings, their
        defaults and their checks are `EngineArgs`'s. `rank_authkey`: the key tensor-parallel ranks
        on other hosts authenticate with (`tp_join.authkey_from_token`)."""
        from disagg.worker.model.loader import load_model

        args = engine_args(model, settings)
        self.args = args
        if args.threads is not None:
            torch.set_num_threads(args.threads)  # process-wide: the engine owns its process's CPU
        model, dtype, device = args.model, args.resolved_dtype(), args.resolved_device()
        if torch.device(device).type == "cpu":
            native_build.build_in_background()  # the native kernels compile while the weights load
        block_size, max_num_seqs = args.block_size, args.max_num_seqs
        self.ranks = None  # the other tensor-parallel ranks' processes, when there are any
        if args.tensor_parallel_size > 1:
            from disagg.worker.model.tp_executor import RankProcesses

            self.ranks = RankProcesses(
                model, dtype, torch.device(device), args.tensor_parallel_size, threads=args.threads,
                local_ranks=args.tensor_parallel_local_ranks, port=args.tensor_parallel_port,
                authkey=rank_authkey, join_timeout=timedelta(seconds=args.tensor_parallel_join_timeout),
            )  # fmt: skip
        try:
            self.model, self.config = load_model(
                model, dtype=dtype, device=device, tp=None if self.ranks is None else self.ranks.tp,
                quantization_setting=args.quantization,
            )  # fmt: skip
            self.model.use_kv_cache_dtype(args.kv_cache_dtype)
            self._build(args, block_size, max_num_seqs, load_tokenizer)
        except BaseException:
            self.close()
            raise

    def _build(self, args: EngineArgs, block_size: int, max_num_seqs: int, load_tokenizer: bool) -> None:
        model, dtype, device = args.model, args.resolved_dtype(), args.resolved_device()
        self.model_path = str(model)
        self.tokenizer = None
        if load_tokenizer:
            from disagg.worker.engine.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_pretrained(model)

        model_len = self.model.max_model_len
        if args.max_model_len is not None:
            if args.max_model_len > model_len:
                raise ValueError(
                    f"max_model_len must be in [2, {model_len}] for this model, got {args.max_model_len}"
                )
            model_len = args.max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        spec = SpeculativeConfig.from_args(args)
        # a draft model loads before the target's cache takes its share of the free memory
        proposer = spec and make_proposer(spec, dtype=dtype, device=device, block_size=block_size,
                                          vocab_size=self.config.vocab_size, max_model_len=model_len,
                                          cuda_graphs=args.cuda_graphs)  # fmt: skip
        num_blocks = plan_num_blocks(
            self.model.kv_cache_block_bytes(block_size),
            self.device,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            useful_blocks=max_num_seqs * -(-model_len // block_size),
            host_reserved=args.kv_host_cache_memory or 0,
        )
        # a lone request must always fit in the cache, or preemption could never make progress
        self.max_model_len = min(model_len, num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs, args.max_num_batched_tokens, mixed_steps=args.mixed_steps
        )
        runner_kwargs = dict(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=args.cuda_graphs,
        )
        if self.ranks is not None:
            self.ranks.start_runners(**runner_kwargs)
        self.runner = ModelRunner(self.model, **runner_kwargs)
        if self.ranks is not None:
            from disagg.worker.model.tp_executor import TensorParallelRunner

            self.ranks.wait_ready()
            self.runner = TensorParallelRunner(self.runner, self.ranks)
        self.tiers = None
        if args.kv_host_cache_memory is not None:
            self.tiers = KVTiers(self.runner.kv_cache, block_size, args.kv_host_cache_memory,
                                 args.kv_disk_cache_dir, args.kv_disk_cache_size)  # fmt: skip
            self.block_manager.on_evict = self.tiers.offload
            self.scheduler.tiers = self.tiers
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.inputs = InputProcessor(self.tokenizer, self.config, self.max_model_len, self.device, args.seed)
        self.outputs = OutputProcessor(self.scheduler, self.requests, self.max_model_len)
        self.speculator = None
        if spec:
            self.speculator = Speculator(
                spec, proposer, runner=self.runner, scheduler=self.scheduler, sampler=self.sampler,
                outputs=self.outputs, max_model_len=self.max_model_len, vocab_size=self.config.vocab_size,
            )  # fmt: skip
            self.outputs.on_finish = self.speculator.forget
        # what the current (or last) step computes; read by layer hooks
        self.scheduled: SchedulerOutput | None = None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and the disk tier's writer (deleting its files);
        idempotent."""
        if getattr(self, "tiers", None) is not None:
            self.tiers.close()
        runner = getattr(self, "runner", None)  # absent when construction failed before it
        if hasattr(runner, "close"):
            runner.close()
        elif self.ranks is not None:
            self.ranks.close()

    # ---- accessors --------------------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        """The whole model's cache [layers, blocks, 2, block_size, Hkv, D] (registered by KV transfer)."""
        return self.runner.kv_cache

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_cache_hit_rate(self) -> float:
        s = self.scheduler
        return s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0

    def cached_prefix_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Leading tokens of a prompt whose K/V this engine holds, in its cache or the tiers below
        (what its prefill would not compute)."""
        hashes = block_hashes(prompt_ids, self.block_size)
        n = len(self.block_manager.lookup(hashes, prompt_ids))
        if self.tiers is not None:
            hit = self.tiers.find(hashes, prompt_ids, n, len(hashes))
            n += len(hit)
            self.tiers.release(hit)
        return n * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the cache and the tiers below (blocks in use keep their
        contents)."""
        self.block_manager.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.clear()

    def holds_block(self, block_hash: int) -> bool:
        """Whether the cache or a tier below holds the block of this hash."""
        if self.block_manager.lookup([block_hash]):
            return True
        return self.tiers is not None and self.tiers.holds(block_hash)

    def has_unfinished(self) -> bool:
        """Whether `step()` has work: waiting or running requests (not reserved or pinned ones)."""
        return self.scheduler.has_work()

    def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks of a running, reserved or prefilled (pinned) request, in sequence order."""
        pinned = self.block_manager.pinned(request_id)
        if pinned is not None:
            return list(pinned)
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return list(req.block_ids)

    # ---- requests ---------------------------------------------------------------------
    def _new_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        prefill_only: bool,
        resume: Resumption | None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.inputs.request(request_id, prompt, params, prefill_only, resume)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        resume: Resumption | None = None,
    ) -> None:
        """Queue a request; its tokens come out of later `step()` calls. With `resume`, it
        continues from outputs another worker produced (`resume.py`)."""
        req = self._new_request(request_id, prompt, params, prefill_only, resume)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if self.tiers is not None and self.tiers.disk is not None:
            self.tiers.prefetch(req.update_block_hashes(self.block_size), req.all_token_ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; False if it is unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == RequestStatus.FINISHED_PREFILLED:
            return self.block_manager.unpin(request_id)
        if req.is_finished:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Free a prefilled request's pinned blocks once their K/V has been sent."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.FINISHED_PREFILLED:
            return False
        del self.requests[request_id]
        return self.block_manager.unpin(request_id)

    def reserve(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        resume: Resumption | None = None,
    ) -> Reservation:
        """Hold blocks for a prompt whose K/V another worker will write; returns their ids in order
        (raises NoFreeBlocksError when the cache is full).

        Leading full blocks this engine's prefix cache already holds are shared, not allocated:
        their K/V is in place, so the sender skips `num_cached_blocks` of them. The block holding
        the last prompt token is always fresh, since the prefill side computes that token to
        sample the first output token.

        With `resume`, the blocks hold the prompt and the resumed outputs (a moved stream, whose
        K/V a prefill worker or the worker that handed it off writes): see `commit_remote_prefill`.
        """
        req = self._new_request(request_id, prompt_ids, params, False, resume)
        blocks = self.scheduler.reserve(req)
        if self.tiers is not None:
            self.tiers.wait_copies()  # blocks it evicted are safe below before another worker writes them
        self.requests[request_id] = req
        return Reservation(blocks, req.num_cached_tokens // self.block_size)

    def commit_remote_prefill(
        self,
        request_id: str,
        first_token: int,
        first_logprob: TokenLogprob | None = None,
        prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> RequestOutput | None:
        """The reserved request's prompt K/V is in place: decode from `first_token` on (with the
        prompt logprobs the prefill side computed, when asked for). Returns the output for the
        first token (already finished if it ends the request).

        A resumed request already has its outputs: `first_token` (what the sender sampled after
        them, without their sampling state) is not used, and the last output is computed by the
        next step, which samples the following token exactly as the stream's first worker would
        have. Returns None then: nothing new to stream yet."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RESERVED:
            raise KeyError(f"no reserved request {request_id!r}")
        if req.output_token_ids:
            self.scheduler.commit_reserved(req)
            return None
        if not 0 <= first_token < self.config.vocab_size:
            raise ValueError(
                f"first_token {first_token} is outside the vocabulary [0, {self.config.vocab_size})"
            )
        self.scheduler.commit_reserved(req)
        if prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        return self.outputs.process([req], [first_token], [first_logprob])[0]

    # ---- stepping ---------------------------------------------------------------------
    def step(self, layer_hook: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Run one forward pass; returns an output for every request that produced a token."""
        out = self.scheduler.schedule()
        self.scheduled = out
        if out is None:
            return []
        plain_decode_from = None
        if self.speculator is not None and not out.is_prefill:
            plain_decode_from = time.perf_counter()
            outputs = self.speculator.step(out)
            if outputs is not None:
                return outputs
        spans = prompt_logprobs.plan(out)
        logits = self.runner.forward(build_batch(out, self.block_size, spans), layer_hook)
        self.scheduler.advance(out)
        reqs = [c.request for c in out.chunks if c.samples]
        if spans:
            prompt_logprobs.record(logits[len(reqs) :], spans)
            logits = logits[: len(reqs)]
        if not reqs:
            return []
        sampled = self.sampler(logits, reqs)
        outputs = self.outputs.process(reqs, sampled.token_ids, sampled.logprobs)
        if plain_decode_from is not None:  # what speculating is measured against
            self.speculator.plain_step(len(out.chunks), time.perf_counter() - plain_decode_from)
        return outputs
