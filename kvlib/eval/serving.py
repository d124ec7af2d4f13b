"""A trace-driven serving simulation: how much KV memory each reservation policy wastes (notebook 07).

The simulated engine does iteration-level (continuous) batching: one **step** is one decode
iteration in which every running sequence produces one token; new requests are admitted (their
prompt prefilled) at the end of a step when memory allows, first come first served. A step is
the unit of simulated time (decode steps are memory-bound and take roughly the same time at
these batch sizes, which is the assumption that makes "completed per step" a throughput).

Policies (what is reserved when a request is admitted):

* ``"contiguous-max"`` — one contiguous buffer of ``max_len`` tokens per sequence, as systems
  before vLLM did (they cannot know the output length in advance).
* ``"contiguous-exact"`` — an oracle that reserves exactly ``prompt_len + output_len``; it still
  wastes the slots reserved for tokens not generated yet.
* ``"paged"`` — blocks of ``block_size`` tokens from a real :class:`kvlib.caches.blocks.BlockAllocator`,
  taken as tokens arrive; when the pool runs out the youngest running request is preempted
  (its blocks freed, the request re-queued and later recomputed), as vLLM does.

Waste is *reserved but unused*: ``sum over steps of (reserved - used) / sum of reserved``, where
``used`` counts distinct tokens stored (a shared prompt counts once).

A request may ask for ``num_samples`` parallel continuations of its prompt; with
``share_prefix=True`` (paged only) the samples fork the prompt's blocks instead of copying them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvlib.caches.blocks import BlockAllocator, blocks_needed

POLICIES = ("contiguous-max", "contiguous-exact", "paged")

# SmolLM2-135M in fp16: 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_FP16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        req_id: index in the trace.
        arrival: arrival time in steps.
        prompt_len: prompt tokens.
        output_len: tokens to generate per sample.
        num_samples: parallel continuations of the prompt (``n`` in the OpenAI / vLLM API).
    """

    req_id: int
    arrival: float
    prompt_len: int
    output_len: int
    num_samples: int = 1


def make_trace(
    num_requests: int,
    seed: int = 0,
    *,
    arrival_rate: float = 1.0,
    prompt_median: float = 110.0,
    prompt_sigma: float = 1.0,
    output_median: float = 220.0,
    output_sigma: float = 0.9,
    max_len: int = 2048,
    num_samples: int = 1,
) -> list[Request]:
    """A seeded synthetic request trace with a ShareGPT-like shape.

    * Arrivals: a Poisson process of ``arrival_rate`` requests per step (exponential gaps).
    * Prompt and output lengths: independent log-normals, ``exp(N(log(median), sigma))``,
      rounded, prompt clipped to ``[4, max_len // 2]`` and output to ``[1, max_len - prompt]``.
      The defaults give means of about 180 prompt / 330 output tokens, close to the ShareGPT
      averages the vLLM paper reports (161 / 338), with the same long tail.

    Returns:
        ``num_requests`` :class:`Request` objects sorted by arrival.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int (got {num_requests!r})")
    for name, value in (
        ("arrival_rate", arrival_rate),
        ("prompt_median", prompt_median),
        ("output_median", output_median),
        ("prompt_sigma", prompt_sigma),
        ("output_sigma", output_sigma),
    ):
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number (got {value!r})")
    if not isinstance(max_len, int) or max_len < 8:
        raise ValueError(f"max_len must be an int >= 8 (got {max_len!r})")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int (got {num_samples!r})")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / arrival_rate, size=num_requests))
    prompts = np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, size=num_requests))
    prompts = np.clip(prompts, 4, max_len // 2).astype(int)
    outputs = np.rint(rng.lognormal(math.log(output_median), output_sigma, size=num_requests))
    outputs = np.clip(outputs, 1, max_len - prompts).astype(int)
    return [
        Request(i, float(arrivals[i]), int(prompts[i]), int(outputs[i]), num_samples)
        for i in range(num_requests)
    ]


@dataclass
class ServingStats:
    """Outcome of :func:`simulate_serving`.

    Attributes:
        policy, block_size, share_prefix: the configuration (``block_size`` is 1 for contiguous).
        capacity_tokens: KV slots that fit in ``capacity_bytes``.
        waste_fraction: reserved-but-unused slots / reserved slots, summed over steps.
        peak_concurrent: most sequences (samples) running in one step.
        mean_concurrent: average sequences running per step.
        busy_concurrent: average sequences running over the steps in which requests were
            waiting (the memory-bound regime; equals ``mean_concurrent`` if none waited).
        completed: requests finished.
        makespan: steps until the last request finished.
        preemptions: requests evicted and recomputed (paged only).
        mean_latency: average steps from arrival to completion.
        reserved, used, concurrent, finished: per-step timelines (slots reserved, slots used,
            sequences running, requests completed so far).
    """

    policy: str
    block_size: int
    share_prefix: bool
    capacity_tokens: int
    waste_fraction: float
    peak_concurrent: int
    mean_concurrent: float
    busy_concurrent: float
    completed: int
    makespan: int
    preemptions: int
    mean_latency: float
    reserved: list[int] = field(default_factory=list, repr=False)
    used: list[int] = field(default_factory=list, repr=False)
    concurrent: list[int] = field(default_factory=list, repr=False)
    finished: list[int] = field(default_factory=list, repr=False)

    @property
    def throughput(self) -> float:
        """Completed requests per simulated step."""
        return self.completed / self.makespan if self.makespan else 0.0

    @property
    def mean_utilization(self) -> float:
        """Average fraction of the KV capacity holding real tokens."""
        if not self.used:
            return 0.0
        return float(np.mean(self.used)) / self.capacity_tokens

    def summary(self) -> dict[str, float | int | str]:
        """One flat row for a table."""
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "waste_%": 100.0 * self.waste_fraction,
            "peak_seqs": self.peak_concurrent,
            "mean_seqs": self.mean_concurrent,
            "busy_seqs": self.busy_concurrent,
            "req_per_kstep": 1000.0 * self.throughput,
            "mean_latency": self.mean_latency,
            "preemptions": self.preemptions,
        }


@dataclass
class _Running:
    req: Request
    admitted: int
    generated: int = 0


def _seq_ids(r: Request) -> list[tuple[int, int]]:
    """The sequence ids of ``r``'s samples in the block allocator."""
    return [(r.req_id, s) for s in range(r.num_samples)]


def _reservation(r: Request, policy: str, max_len: int) -> int:
    """Slots a contiguous policy reserves when it admits ``r``."""
    per = max_len if policy == "contiguous-max" else r.prompt_len + r.output_len
    return per * r.num_samples


def _check_config(
    requests: list[Request], policy: str, block_size: int, share_prefix: bool, bytes_per_token: int
) -> None:
    """Reject an unknown policy, bad sizes, a contiguous shared prefix or an empty trace."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES} (got {policy!r})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (got {block_size!r})")
    if share_prefix and policy != "paged":
        raise ValueError(
            "share_prefix=True needs policy='paged' (contiguous buffers cannot be shared)"
        )
    if not isinstance(bytes_per_token, int) or bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be a positive int (got {bytes_per_token!r})")
    if not requests:
        raise ValueError("requests is empty; build one with make_trace()")


def _check_requests(
    requests: list[Request],
    policy: str,
    bs: int,
    capacity: int,
    capacity_bytes: int,
    bytes_per_token: int,
    max_len: int,
    max_num_seqs: int,
) -> None:
    """Reject a request longer than ``max_len`` or one that could never fit even alone."""
    for r in requests:
        if r.prompt_len + r.output_len > max_len:
            raise ValueError(
                f"request {r.req_id} needs {r.prompt_len + r.output_len} > max_len {max_len}"
            )
        need = (
            blocks_needed(r.prompt_len + r.output_len, bs) * r.num_samples * bs
            if policy == "paged"
            else _reservation(r, policy, max_len)
        )
        if need > capacity or r.num_samples > max_num_seqs:
            raise ValueError(
                f"request {r.req_id} needs {need} KV slots alone but capacity is {capacity} "
                f"({capacity_bytes} bytes / {bytes_per_token} bytes per token)"
            )


class _Engine:
    """The simulated engine's KV memory: a block pool (paged) or contiguous reservations."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        bs: int,
        max_len: int,
        share_prefix: bool,
        watermark: float,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.bs = bs
        self.max_len = max_len
        self.share_prefix = share_prefix
        self.alloc = BlockAllocator(max(capacity // bs, 1), bs) if policy == "paged" else None
        self.keep_free = int(watermark * self.alloc.num_blocks) if self.alloc else 0
        self.reserved_contig = 0

    def reserved(self) -> int:
        """KV slots reserved now (whole blocks when paged)."""
        return self.alloc.num_used * self.bs if self.alloc is not None else self.reserved_contig

    def release(self, run: _Running) -> None:
        """Free what ``run`` holds."""
        if self.alloc is not None:
            for sid in _seq_ids(run.req):
                self.alloc.free(sid)
        else:
            self.reserved_contig -= _reservation(run.req, self.policy, self.max_len)

    def used_slots(self, run: _Running) -> int:
        """Distinct tokens ``run`` stores (a shared prompt counts once)."""
        r = run.req
        if self.share_prefix:
            return r.prompt_len + r.num_samples * run.generated
        return r.num_samples * (r.prompt_len + run.generated)

    def blocks_for_step(self, run: _Running) -> int:
        """Exact new blocks one more token per sample takes (new blocks + copies on write)."""
        alloc, bs = self.alloc, self.bs
        assert alloc is not None
        need, counts = 0, {}
        for sid in _seq_ids(run.req):
            if alloc.seq_len(sid) % bs == 0:
                need += 1
                continue
            last = alloc.last_block(sid)
            c = counts.get(last, alloc.refcount(last))
            if c > 1:
                need += 1
                counts[last] = c - 1
        return need

    def blocks_to_admit(self, run: _Running) -> int:
        """Blocks (re)admitting ``run`` takes, copies on write included (exact)."""
        r, g, bs = run.req, run.generated, self.bs
        if not self.share_prefix:
            return r.num_samples * blocks_needed(r.prompt_len + g, bs)
        if g == 0:
            return blocks_needed(r.prompt_len, bs)
        # The full prompt blocks stay shared; every sample ends up with its own copy of the
        # partly filled one (all but the last writer copy it) plus the blocks of its g tokens.
        full = r.prompt_len // bs
        return full + r.num_samples * (blocks_needed(r.prompt_len + g, bs) - full)

    def decode(self, running: list[_Running], queue: deque[_Running]) -> int:
        """One decode step: every running sequence appends one token (oldest request first);
        when the pool is short, the youngest running request is preempted (vLLM's recompute
        policy) and goes back to the front of ``queue``. Returns the preemptions."""
        alloc = self.alloc
        preemptions = 0
        i = 0
        while i < len(running):
            run = running[i]
            if alloc is not None:
                need = self.blocks_for_step(run)
                while alloc.num_free < need and running[-1] is not run:
                    victim = running.pop()
                    self.release(victim)
                    preemptions += 1
                    queue.appendleft(victim)
                if alloc.num_free < need:  # run is the youngest: preempt it
                    running.pop()
                    self.release(run)
                    preemptions += 1
                    queue.appendleft(run)
                    break
                for sid in _seq_ids(run.req):
                    alloc.append_slots(sid, 1)
            run.generated += 1
            i += 1
        return preemptions

    def admit(
        self, running: list[_Running], queue: deque[_Running], step: int, max_num_seqs: int
    ) -> None:
        """Admit waiting requests (FCFS, no skipping) while they fit."""
        alloc = self.alloc
        while queue:
            run = queue[0]
            r = run.req
            if sum(x.req.num_samples for x in running) + r.num_samples > max_num_seqs:
                break
            if alloc is not None:
                if alloc.num_free - self.blocks_to_admit(run) < (self.keep_free if running else 0):
                    break
                first, *rest = _seq_ids(r)
                alloc.allocate(first, r.prompt_len)
                for sid in rest:
                    if self.share_prefix:
                        alloc.fork(first, sid)
                    else:
                        alloc.allocate(sid, r.prompt_len)
                if run.generated:
                    for sid in _seq_ids(r):
                        alloc.append_slots(sid, run.generated)
            else:
                reservation = _reservation(r, self.policy, self.max_len)
                if self.reserved_contig + reservation > self.capacity:
                    break
                self.reserved_contig += reservation
            queue.popleft()
            run.admitted = step
            running.append(run)


@dataclass
class _Timelines:
    """What :func:`simulate_serving` records step by step."""

    reserved: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    concurrent: list[int] = field(default_factory=list)
    waiting: list[bool] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    preemptions: int = 0

    def record(self, engine: _Engine, running: list[_Running], queue: deque[_Running]) -> None:
        """Record this step's reserved and used slots, sequences running and waiting."""
        self.reserved.append(engine.reserved())
        self.used.append(sum(engine.used_slots(x) for x in running))
        self.concurrent.append(sum(x.req.num_samples for x in running))
        self.waiting.append(bool(queue))

    def retire(self, engine: _Engine, running: list[_Running], step: int) -> list[_Running]:
        """Release the finished requests, record their latency; return those still running."""
        still = []
        for run in running:
            if run.generated >= run.req.output_len:
                engine.release(run)
                self.latencies.append(step + 1 - run.req.arrival)
            else:
                still.append(run)
        self.finished.append(len(self.latencies))
        return still

    def stats(
        self, policy: str, bs: int, share_prefix: bool, capacity: int, steps: int
    ) -> ServingStats:
        """The :class:`ServingStats` of a finished run of ``steps`` steps."""
        conc_t = self.concurrent
        busy = [c for c, w in zip(conc_t, self.waiting, strict=True) if w]
        total_reserved = sum(self.reserved)
        waste = (total_reserved - sum(self.used)) / total_reserved if total_reserved else 0.0
        return ServingStats(
            policy=policy,
            block_size=bs,
            share_prefix=share_prefix,
            capacity_tokens=capacity,
            waste_fraction=waste,
            peak_concurrent=max(conc_t),
            mean_concurrent=float(np.mean(conc_t)),
            busy_concurrent=float(np.mean(busy)) if busy else float(np.mean(conc_t)),
            completed=len(self.latencies),
            makespan=steps,
            preemptions=self.preemptions,
            mean_latency=float(np.mean(self.latencies)),
            reserved=self.reserved,
            used=self.used,
            concurrent=conc_t,
            finished=self.finished,
        )


def simulate_serving(
    requests: list[Request],
    capacity_bytes: int,
    policy: str,
    block_size: int = 16,
    *,
    bytes_per_token: int = SMOLLM2_FP16_BYTES_PER_TOKEN,
    max_len: int = 2048,
    max_num_seqs: int = 256,
    share_prefix: bool = False,
    watermark: float = 0.01,
) -> ServingStats:
    """Replay ``requests`` through an engine with ``capacity_bytes`` of KV memory under ``policy``.

    Args:
        requests: e.g. from :func:`make_trace`.
        capacity_bytes: KV memory budget.
        policy: one of ``"contiguous-max"``, ``"contiguous-exact"``, ``"paged"``.
        block_size: tokens per block (``"paged"`` only).
        bytes_per_token: KV bytes of one token over all layers (default: SmolLM2-135M, fp16).
        max_len: the engine's maximum sequence length (what ``"contiguous-max"`` reserves).
        max_num_seqs: cap on running sequences (vLLM's default on most GPUs; 1,024 on cards of 70 GiB
            or more other than the A100).
        share_prefix: parallel samples fork the prompt's blocks (``"paged"`` only).
        watermark: fraction of blocks kept free when admitting (paged), to avoid instant preemption.

    Returns:
        :class:`ServingStats`.

    Raises:
        ValueError: unknown policy, or a request that could never fit even alone.
    """
    _check_config(requests, policy, block_size, share_prefix, bytes_per_token)
    capacity = int(capacity_bytes) // bytes_per_token
    bs = block_size if policy == "paged" else 1
    _check_requests(
        requests, policy, bs, capacity, capacity_bytes, bytes_per_token, max_len, max_num_seqs
    )
    engine = _Engine(policy, capacity, bs, max_len, share_prefix, watermark)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    queue: deque[_Running] = deque()  # preempted requests go back to the front, progress kept
    running: list[_Running] = []
    timelines = _Timelines()
    step = 0
    while pending or queue or running:
        while pending and pending[0].arrival <= step:
            queue.append(_Running(pending.popleft(), admitted=-1))
        timelines.preemptions += engine.decode(running, queue)  # 1. decode
        engine.admit(running, queue, step, max_num_seqs)  # 2. admit waiting requests
        if queue and not running:  # the whole pool is free and the head still does not fit
            raise RuntimeError(  # pragma: no cover - the up-front check rules this out
                f"request {queue[0].req.req_id} cannot be admitted into an empty engine"
            )
        timelines.record(engine, running, queue)  # 3. record this step, then retire
        running = timelines.retire(engine, running, step)
        step += 1
    return timelines.stats(policy, bs, share_prefix, capacity, step)
