"""NativeEngine: the rollout engine on rlloom's own model code (continuous batching, paged KV cache).

    engine = NativeEngine.from_pretrained("smollm2-135m-instruct", max_model_len=1024)
    completions = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=256))

`generate` is built on the step-level API: `add_request` queues a prompt (its n samples), `step`
runs one scheduled forward and returns the completions that finished, `abort` ends in-flight
requests, and `resume_request` continues an aborted sample from its tokens so far (a partial
rollout across a weight update). A step is schedule -> (copy-on-write block copies) -> forward -> sample, queued on the
device without waiting; then the previous step's sampled tokens are read back and recorded. So one
step is always in flight: the host schedules and prepares step k + 1 (and records step k - 1's
tokens) while the device computes step k, and step k + 1 takes the tokens of step k straight from
the device (`Scheduler.launched`/`resolve`, pending tokens in sequence.py). Results are the same as
running the steps one after the other; completions come out of the step() after the one that
sampled their last token.

Requests are validated one by one: a bad one (empty prompt, prompt of max_model_len tokens or more,
token ids outside the vocabulary, invalid SamplingParams, stop strings without `decode`, a sequence
larger than the whole KV cache) comes back as completions with finish_reason "abort" and `error`
set, and the other requests proceed.

Tensor parallelism (`tp_group`, rollout.tp ranks, each calling every method with the same
arguments): every rank schedules alike, runs its shard of the model (tensor_parallel.py) and gets
the same tokens from the vocabulary-parallel sampler (vocab_parallel.py), the tokens tp = 1 gives.

Weights: `update_weights` copies Hugging Face-named tensors in place (the CUDA graphs stay valid);
`sleep` frees the KV cache (and optionally moves the weights to CPU), `wake` takes them back (the
CUDA graphs are captured again on first use).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Collection, Iterable

import torch
import torch.distributed as dist

from rlloom.config import RolloutConfig
from rlloom.data.images import ImageInputs
from rlloom.devices import to_device
from rlloom.engines.rollout.base import Completion, Partial, SamplingParams
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.engine_parts import build_sampler, caches_prefixes, eos_ids, prepare
from rlloom.engines.rollout.native.in_flight import HostBuffers, InFlight, launched, route_spans
from rlloom.engines.rollout.native.model_runner import ModelRunner
from rlloom.engines.rollout.native.sampler import SamplingRows, noise_key
from rlloom.engines.rollout.native.scheduler import Batch, Scheduler
from rlloom.engines.rollout.native.sequence import Sequence, Status
from rlloom.engines.rollout.native.tp_weights import load_sharded, shard_dims_by_hf_name
from rlloom.engines.rollout.native.validation import kv_cache_blocks, request_problem
from rlloom.engines.rollout.native.vision import request_vision
from rlloom.models.args import ModelArgs
from rlloom.models.exact import exact_numerics
from rlloom.observability.startup import mark_first_token


class NativeEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_model_len: int = 2048,
        num_blocks: int = 0,
        kv_cache_memory_gb: float = 1.0,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        enforce_eager: bool = False,
        compile: bool = True,
        enable_prefix_sharing: bool = True,
        enable_prefix_caching: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        eos_token_ids: Iterable[int] | None = None,
        seed: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        quantization: str = "none",
        exact: bool = False,
    ) -> None:
        """Wrap a loaded `rlloom.models.CausalLM`; `decode(token_ids) -> str` enables stop strings.
        `quantization="fp8"` quantizes the model's routed experts in place (`rlloom.models.fp8`;
        `rollout.quantization`): weight updates are quantized as they are copied in.
        With `tp_group` (the ranks of one tensor-parallel replica, each passing the same full model,
        or its own shard from `tp_weights.from_pretrained_sharded`, and calling every method with the
        same arguments) this rank keeps its shard of the model (tensor_parallel.py) and samples from
        its vocabulary slice (vocab_parallel.py). `enable_prefix_caching` keeps the keys and values of
        finished sequences' full blocks for later requests that start with the same tokens (multi-turn
        episodes: a trajectory's next turn; block_manager.py), except where `engine_parts.caches_prefixes` says no.
        `exact` runs the forward and the sampler's logprobs with batch-invariant numerics (uncompiled;
        on CUDA the decode replays CUDA graphs captured under them)."""
        # The settings were checked where the run config was read (rlloom/config/rollout.py).
        assert max_model_len >= 2 and max_num_batched_tokens >= 1, (max_model_len, max_num_batched_tokens)
        self.model = model.eval()
        self.exact = exact  # rollout.match_training: a token's logprob equals the training forward's
        self.device = next(model.parameters()).device
        self.tp = prepare(model, quantization, tp_group)
        """This rank's part of a tensor-parallel replica (None: the whole model on one device)."""
        num_blocks = kv_cache_blocks(
            model.args,
            num_blocks=num_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            block_size=block_size,
            dtype=next(model.parameters()).dtype,
            device=self.device,
        )
        self.max_model_len, self.max_num_seqs, self.decode = max_model_len, max_num_seqs, decode
        self.enable_prefix_sharing = enable_prefix_sharing
        self.policy_version = 0
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            # A preempted sequence of up to max_model_len tokens must fit in one prefill.
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            max_model_len=max_model_len,
            eos_token_ids=eos_ids(model) if eos_token_ids is None else eos_token_ids,
            decode=decode,
        )
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            compile=compile and not exact,  # graphs of the plain forward: compiled layers round differently
        )
        if not caches_prefixes(self.runner):
            self.block_manager.enable_prefix_caching = False
        self.sampler = build_sampler(self.device, seed, self.tp, tp_group)
        self._seq_ids, self._arrivals = itertools.count(), itertools.count()
        self._ready: list[Completion] = []
        self._in_flight: InFlight | None = None
        self._host = HostBuffers(max_num_seqs)
        self._offloaded = False
        self.last_batch: Batch | None = None
        """The batch the last step() ran (None if it ran nothing): for benchmarks and metrics."""

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs: object,
    ) -> NativeEngine:
        """Load a checkpoint folder (or the embedded model name); `decode` comes from its tokenizer
        when the folder has one and none is passed. Other keywords as in `NativeEngine(...)`."""
        from rlloom.models import from_pretrained, load_decoder

        model = from_pretrained(path_or_name, dtype=dtype, device=device, fused_projections=True)
        if kwargs.get("decode") is None:
            kwargs["decode"] = load_decoder(path_or_name)
        return cls(model, **kwargs)

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        config: RolloutConfig,
        *,
        max_model_len: int,
        decode: Callable[[list[int]], str] | None = None,
        seed: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        enable_prefix_caching: bool = False,
    ) -> NativeEngine:
        """Build from the run's `RolloutConfig` (cache and batching fields) and runtime objects."""
        return cls(
            model,
            max_model_len=max_model_len,
            num_blocks=config.num_blocks,
            kv_cache_memory_gb=config.kv_cache_memory_gb,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=config.enforce_eager,
            compile=config.compile,
            decode=decode,
            seed=seed,
            tp_group=tp_group,
            quantization=config.quantization,
            exact=config.match_training,
        )

    # ---- step-level API -------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        prompt_index: int | None = None,
        images: ImageInputs | None = None,
        first_sample: int = 0,
    ) -> str:
        """Queue `sampling.n` completions of one prompt; returns the request id (made if not given).
        `images`: the prompt's processed images (a vision-language model), encoded here once for
        all n samples. `first_sample`: the first sample's index (samples are `first_sample + j`:
        their completions' `sample_index` and seeded noise), so that sample j of a group sent alone
        draws what it draws as one of the group's n."""
        arrival = next(self._arrivals)
        request_id = f"req-{arrival}" if request_id is None else request_id
        prompt_index = arrival if prompt_index is None else prompt_index
        vision, error = request_vision(
            self.model, prompt_ids, images, key_pictures=self.block_manager.enable_prefix_caching
        )
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                prompt_index=prompt_index,
                sample_index=first_sample + j,
                prompt_ids=list(prompt_ids),
                params=sampling,
                policy_version=self.policy_version,
                vision=vision,
            )
            for j in range(max(sampling.n, 1))
        ]
        error = error or self._request_problem(prompt_ids, sampling)
        if error is not None:
            for seq in seqs:
                seq.status, seq.finish_reason, seq.error = Status.FINISHED, "abort", error
                self._ready.append(seq.completion())
            return request_id
        group = self.max_num_seqs if self.enable_prefix_sharing else 1
        for start in range(0, len(seqs), group):
            leader, *forks = seqs[start : start + group]
            leader.forks = forks
            self.scheduler.add(leader)
        return request_id

    def _request_problem(self, prompt_ids: list[int], sampling: SamplingParams) -> str | None:
        """Why this engine must reject the request (validation.py), or None."""
        return request_problem(
            prompt_ids,
            sampling,
            max_model_len=self.max_model_len,
            vocab_size=self.model.args.vocab_size,
            can_decode=self.decode is not None,
            block_manager=self.block_manager,
        )

    def resume_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        output_ids: list[int],
        logprobs: list[float],
        request_id: str,
        prompt_index: int,
        sample_index: int,
        images: ImageInputs | None = None,
    ) -> str:
        """Continue one sample from the tokens it had when it was aborted (e.g. across a weight
        update): its KV cache is rebuilt by a prefill of prompt + `output_ids` under the current
        weights, the given tokens and `logprobs` stay as they are, and sampling continues at token
        position len(output_ids) with the same seeded noise (`sample_index` as before). The
        completion carries the current policy version; `sampling.n` is ignored (one sample). MoE:
        its routes are those of the resuming weights for every position (the prefill recomputes them)."""
        vision, error = request_vision(
            self.model, prompt_ids, images, key_pictures=self.block_manager.enable_prefix_caching
        )
        error = error or self._request_problem(prompt_ids, sampling)
        if error is not None or len(logprobs) != len(output_ids):
            raise ValueError(
                error or f"resume_request: {len(logprobs)} logprobs for {len(output_ids)} output tokens"
            )
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=list(prompt_ids),
            params=sampling,
            policy_version=self.policy_version,
            output_ids=list(output_ids),
            logprobs=list(logprobs),
            vision=vision,
        )
        self.scheduler.add(seq)
        return request_id

    def step(self) -> list[Completion]:
        """Launch the next scheduled step, then record the previous one; return the completions
        finished since the last call."""
        if self.runner.backend is None and self.scheduler.has_unfinished():
            raise ValueError("step() on a sleeping engine: its KV cache is freed. Fix: call wake() first.")
        batch = self.last_batch = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        if batch is not None:
            self._in_flight = self._launch(batch, previous)
        if previous is not None:
            self._resolve(previous)
        ready, self._ready = self._ready, []
        return ready

    def _launch(self, batch: Batch, previous: InFlight | None) -> InFlight:
        """Queue `batch`'s forward and sampling on the device and record it as launched."""
        rows = self._sampling_rows(batch)  # host work and copies queued before the forward
        self.runner.copy_blocks(self.block_manager.take_pending_copies())
        spans = route_spans(batch)
        with exact_numerics(self.exact):
            logits_SV = self.runner.run(
                batch.seqs, batch.is_prefill, None if previous is None else previous.token_ids_R
            )
            if batch.row_source != list(range(len(batch.seqs))):
                logits_SV = logits_SV[to_device(torch.tensor(batch.row_source), logits_SV.device)]
            token_ids_R, logprobs_R = self.sampler(logits_SV, rows)
        offsets = self.scheduler.launched(batch)
        return launched(batch, spans, offsets, token_ids_R, logprobs_R, self.runner.last_routes, self._host)

    def _resolve(self, step: InFlight) -> None:
        """Wait for a launched step's tokens and record them (finished sequences go to `_ready`)."""
        step.wait()
        if step.routes is not None:  # before the tokens: a sequence that finishes now takes them along
            # One split for the whole step (the spans tile the forward's rows in order): a slice per
            # row was about a third of the host's work per decode step at 256 sequences.
            sizes = [n for _, n, _ in step.route_spans]
            chunks = step.routes[: sum(sizes)].split(sizes)
            for seq, source in zip(step.rows, step.row_source):
                if seq.status is not Status.FINISHED:
                    seq.record_routes(step.route_spans[source][0], chunks[source])
        token_ids, logprobs = step.host_token_ids_R.tolist(), step.host_logprobs_R.tolist()
        mark_first_token()  # the process's first generated token: a start-up phase
        for seq in self.scheduler.resolve(step.rows, step.offsets, token_ids, logprobs):
            self._ready.append(seq.completion())

    def _drain(self) -> None:
        """Record the step in flight, if any: afterwards every sequence holds only real tokens."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._resolve(step)

    def _sampling_rows(self, batch: Batch) -> SamplingRows:
        params = [seq.params for seq in batch.rows]
        return SamplingRows.build(
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.top_k for p in params],
            [
                None if p.seed is None else noise_key(p.seed, seq.sample_index, len(seq.output_ids))
                for p, seq in zip(params, batch.rows)
            ],
            self.device,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ready) or self._in_flight is not None

    def partial(self, request_ids: Collection[str]) -> list[Partial]:
        """The resolved tokens of the unfinished samples of `request_ids` (a launched step's pending
        tokens, `sequence.pending`, are the last ones and are left out)."""
        out = []
        for leader in (*self.scheduler.running, *self.scheduler.waiting):
            for seq in (leader, *leader.forks):
                if seq.request_id not in request_ids or seq.finish_reason is not None:
                    continue
                k = len(seq.output_ids)
                while k and seq.output_ids[k - 1] < 0:
                    k -= 1
                out.append(Partial(seq.request_id, seq.sample_index, seq.output_ids[:k], seq.logprobs[:k]))
        return out

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests; their completions (tokens so far, "abort") come out of the next step()."""
        self._drain()
        for seq in self.scheduler.abort(set(request_ids)):
            self._ready.append(seq.completion())

    # ---- batch API ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        images: list[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Completions of every prompt, ordered by (prompt index, sample index); `images`: each
        prompt's, or None."""
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(
                f"generate: {len(per_prompt)} SamplingParams for {len(prompts)} prompts. "
                "Fix: pass one SamplingParams, or one per prompt."
            )
        if self.has_unfinished():
            raise ValueError(
                "generate: requests added with add_request are still in flight. Fix: step() them out first."
            )
        for i, (prompt, params) in enumerate(zip(prompts, per_prompt)):
            self.add_request(prompt, params, request_id=str(i), prompt_index=i, images=images and images[i])
        out: list[Completion] = []
        while self.has_unfinished():
            out += self.step()
        return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))

    # ---- weights and memory ---------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy Hugging Face-named tensors into the model in place and set the policy version. A
        tensor-parallel rank takes full tensors (and keeps its slice) or tensors of its slice's shape."""
        from rlloom.models import load_hf_tensors

        if self.tp is None:
            load_hf_tensors(self.model, named_tensors)
        else:
            load_sharded(self.model, self.tp, named_tensors)
        self.block_manager.clear_prefix_cache()  # keys and values of the old weights
        self.policy_version = version

    @property
    def full_args(self) -> ModelArgs:
        """The whole model's architecture (under tensor parallelism `model` holds this rank's slice)."""
        return self.model.args if self.tp is None else self.tp.full_args

    def weight_shard_dims(self) -> dict[str, int | None]:
        """The shard spec: for each Hugging Face weight name the dim this engine's ranks split it on,
        None when every rank holds the whole tensor (always None at tp = 1). Rank r holds the r-th of
        tp equal parts of that dim, except KV heads replicated when tp > num_key_value_heads and the
        vocabulary rows (embedding, lm head), padded to a multiple of 4 per rank: `weight_shard_slices`
        gives this rank's exact (dim, start, length)."""
        return {
            name: None if shard is None else shard[0] for name, shard in self.weight_shard_slices().items()
        }

    def weight_shard_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Hugging Face weight name -> (dim, start, length) of the full tensor this rank holds, or None
        when it holds all of it; `update_weights` accepts that slice in place of the full tensor."""
        if self.tp is None:
            from rlloom.models.adapter import hf_slots

            return {name: None for name, _ in hf_slots(self.model)}
        shards = shard_dims_by_hf_name(self.model, self.tp)
        return {name: None if s is None else (s.dim, s.start, s.length) for name, s in shards.items()}

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache (and with offload_weights move the weights to CPU); requests must be done."""
        if self.scheduler.has_unfinished():
            raise ValueError(
                "sleep() with requests in flight would lose their KV cache. Fix: finish or abort() them first."
            )
        self.runner.free()
        self.block_manager.clear_prefix_cache()
        if offload_weights and self.device.type != "cpu":
            self.model.to("cpu")
            self._offloaded = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        """Take back the weights and the KV cache (the CUDA graphs are captured again on first use)."""
        if self._offloaded:
            self.model.to(self.device)
            self._offloaded = False
        if self.runner.backend is None:
            self.runner.allocate()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
