"""SharedEngine: one engine, driven by one thread of its own, serving callers on any thread.

A rollout worker runs several rollout calls at once in async mode (rl/loop/trainer.py): while the
episodes of one iteration wait for their tools, those of the next can generate. The calls run on
threads of the worker's Ray actor, but vLLM's CPU backend keeps per-thread state (its OpenMP team
and the thread count its attention metadata is built for: rollout/openai_api.py `Batcher` tells
what broke), so the engine is made, and every call into it runs, on one thread: this one.

- Continuous batching, where the engine can be stepped (`add`/`step`/`abort`: the vLLM engine):
  a `generate` request joins the running batch at the next engine step, whatever its sampling
  settings, and each of its prompts leaves the batch when it ends; the request returns when its
  last prompt has. So a caller with one episode's turn gets it back as soon as that turn is
  sampled, while longer ones go on (`continuous_batching`; the agent loop then runs each episode
  on its own: rollout/agent_loop.py).
- Otherwise (the native engine), `generate` requests that wait together with the same sampling
  settings are merged into one engine call, so concurrent episodes share a batch as they would in
  one call.
- Either way a request gets what it would have got alone, up to the engine's numerics at a
  different batch shape (seeds are per prompt).
- Everything else (`load_weights`, `score`, `call(fn)`) runs alone, in the order it was queued:
  once the requests queued before it have ended, and before any queued after it starts. So a load
  never lands inside a batch.
- A load that fails partway leaves the engine *torn* (some tensors new, the rest old): it then
  refuses every generate and score request (`TornWeights`) until a load completes, rather than
  serve a mix under the old version's number.
- Each `Generation` carries the policy version it was sampled with (`Generation.version`): a
  load queued by another caller may land between two of a caller's requests.

A request can be cancelled (`generate(..., cancel=event)`): once the event is set, its prompts
leave the batch at the next step (their engine requests aborted, the rest of the batch goes on) and
the call raises `Cancelled`; one not started yet never starts. The OpenAI-compatible endpoint cancels
the requests of a client that went away or ran past its deadline (rollout/openai_api.py). Merged
calls (engines that cannot be stepped) can be cancelled only before they start.

Not covered: preempting running requests (a load waits for those in flight to end).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class Cancelled(RuntimeError):
    """A generate request whose `cancel` event was set before it ended."""


class TornWeights(RuntimeError):
    """A request to an engine whose last weight load failed partway: it holds some tensors of the
    new version and the rest of the old one, a model nobody trained, so it serves nothing until a
    load completes (`SharedEngine.load`)."""


@dataclass
class _Generate:
    key: tuple
    prompts: list
    max_tokens: list[int]
    seeds: list | None
    done: Future = field(default_factory=Future)
    # continuous batching: per prompt, None until it ends
    results: list = field(default_factory=list)
    cancel: threading.Event | None = None

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def sampling(self) -> dict:
        """The engine's sampling options of the request (all but the per-prompt ones)."""
        temperature, top_p, stop, options, _ = self.key
        return dict(
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=list(stop) or None,
            **{k: _unhashable(v) for k, v in options},
        )


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: Future = field(default_factory=Future)


class SharedEngine:
    """The engine that `make()` builds, owned by a thread of its own; the Engine protocol
    (rollout/engines/base.py) for callers on any thread."""

    def __init__(self, make: Callable[[], Any], name: str = "engine"):
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self._closed = False
        # prompts per engine generate call, or that joined the batch together
        self.batch_sizes: list[int] = []
        self.requests_merged = 0  # generate requests that shared the engine's batch with another
        self.aborted = 0  # prompts taken out of the running batch by a cancelled request
        self.torn: str | None = None  # why the served weights are a mix of versions (`load`)
        self._busy_s = 0.0  # seconds spent in finished engine calls
        self._call_started: float | None = None  # when the call in progress began
        self._timing = threading.Lock()  # the two above change together
        self.continuous_batching = (
            False  # set by the engine's thread, before it hands the engine over
        )
        started: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(make, started), name=name, daemon=True
        )
        self._thread.start()
        self._engine = started.result()  # the engine's own construction error is raised here

        # its signature: callers check which options it takes
        @functools.wraps(self._engine.generate)
        def generate(prompts, **kwargs):
            return self._generate_request(prompts, **kwargs)

        self.generate = generate

    @property
    def busy_s(self) -> float:
        """Seconds the engine has spent in calls, the one in progress included (its utilisation,
        against wall time)."""
        with self._timing:
            started = self._call_started
            return self._busy_s + (time.perf_counter() - started if started is not None else 0.0)

    # --- the protocol ---
    @property
    def version(self) -> int:
        return self._engine.version

    def _generate_request(
        self,
        prompts,
        *,
        max_tokens,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids=None,
        seeds=None,
        cancel: threading.Event | None = None,
        **sampling,
    ):
        if not prompts:
            return []
        max_tokens = (
            [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        )
        options = tuple(sorted((k, _hashable(v)) for k, v in sampling.items()))
        # seeded and unseeded requests never share a call: the engine takes seeds for all or none
        key = (temperature, top_p, tuple(stop_token_ids or ()), options, seeds is not None)
        return self._submit(
            _Generate(
                key,
                list(prompts),
                max_tokens,
                None if seeds is None else list(seeds),
                cancel=cancel,
            )
        )

    def load_weights(self, named_tensors, version: int) -> dict:
        return self.load(lambda engine: engine.load_weights(named_tensors, version), version)

    def load(self, fn: Callable[[Any], Any], version: int) -> Any:
        """`fn(engine)`, a load of `version` into the engine in place, run like `call`. A load that
        raises may have replaced some tensors and not others: the engine is then *torn* (`torn`
        says how) and every generate and score request fails with `TornWeights` until a load
        completes; the version the engine reports stays the last complete one."""

        def guarded(engine):
            try:
                out = fn(engine)
            except BaseException as exc:
                self.torn = (
                    f"the load of version {version} failed partway ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:200]}), leaving a mix of versions "
                    f"{engine.version} and {version}"
                )
                raise
            # a load the caller skipped (`superseded`: a newer version is in) restores nothing
            if not (isinstance(out, dict) and "superseded" in out):
                self.torn = None
            return out

        return self.call(guarded)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.call(lambda engine: self._untorn() or engine.score(token_ids))

    def score_batch(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.call(lambda engine: self._untorn() or engine.score_batch(sequences))

    def _untorn(self) -> None:
        """Raise `TornWeights` when the engine is torn (see `load`); on the engine's thread."""
        if self.torn is not None:
            raise self._torn_error()

    def _torn_error(self) -> TornWeights:
        return TornWeights(f"the engine serves nothing: {self.torn}; a complete load restores it")

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine's thread, alone; its result (or its exception)."""
        return self._submit(_Call(fn))

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._thread.join(timeout=30)

    # --- the engine's thread ---
    def _submit(self, item):
        with self._ready:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._queue.append(item)
            self._ready.notify()
        return item.done.result()

    def _run(self, make, started: Future) -> None:
        try:
            engine = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructing thread
            started.set_exception(exc)
            return
        self.continuous_batching = all(
            callable(getattr(engine, name, None)) for name in ("add", "step", "abort")
        )
        started.set_result(engine)
        (self._serve_continuous if self.continuous_batching else self._serve_merged)(engine)

    def _timed(self, fn, *args) -> None:
        with self._timing:
            self._call_started = t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            with self._timing:
                self._busy_s += time.perf_counter() - t0
                self._call_started = None

    def _serve_merged(self, engine) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                first = self._queue.popleft()
                batch = [first]
                # the generate requests queued right behind it with the same settings share its call;
                # the first other item stops the merge, so nothing overtakes a load queued before it
                while (
                    isinstance(first, _Generate)
                    and self._queue
                    and isinstance(self._queue[0], _Generate)
                    and self._queue[0].key == first.key
                ):
                    batch.append(self._queue.popleft())
            if isinstance(first, _Call):
                self._timed(_settle, first.done, functools.partial(first.fn, engine))
            else:
                self._timed(self._generate, engine, batch)

    def _serve_continuous(self, engine) -> None:
        # engine request id -> (request, prompt index)
        running: dict[str, tuple[_Generate, int]] = {}
        ids = itertools.count()
        while True:
            call = None
            with self._ready:
                while not self._queue and not running and not self._closed:
                    self._ready.wait()
                if not self._queue and not running:
                    return
                # the generate requests at the head join the batch; the first other item stops them, and
                # runs once the batch has emptied, so nothing overtakes it and it never lands inside a batch
                joining = []
                while self._queue and isinstance(self._queue[0], _Generate):
                    joining.append(self._queue.popleft())
                if not running and not joining:
                    call = self._queue.popleft()
            if call is not None:
                self._timed(_settle, call.done, functools.partial(call.fn, engine))
                continue
            if joining:
                self.batch_sizes.append(sum(len(r.prompts) for r in joining))
                self.requests_merged += len(joining) if running or len(joining) > 1 else 0
            self._timed(self._step, engine, joining, running, ids)

    def _step(self, engine, joining: list[_Generate], running: dict, ids) -> None:
        for r in joining:
            if r.cancelled():  # cancelled while it waited: never started
                r.done.set_exception(Cancelled("the request was cancelled before it started"))
                continue
            if self.torn is not None:  # a load failed partway: nothing is sampled from the mix
                r.done.set_exception(self._torn_error())
                continue
            r.results, added = [None] * len(r.prompts), []
            try:
                for i, prompt in enumerate(r.prompts):
                    rid = str(next(ids))
                    engine.add(
                        rid,
                        prompt,
                        max_tokens=r.max_tokens[i],
                        seed=None if r.seeds is None else r.seeds[i],
                        **r.sampling(),
                    )
                    added.append(rid)
                    running[rid] = (r, i)
            except BaseException as exc:  # noqa: BLE001 - the request's caller gets it; the others go on
                for rid in added:
                    running.pop(rid)
                _quietly(functools.partial(engine.abort, added))
                r.done.set_exception(exc)
        if not running:
            return
        try:
            ended = engine.step()
        except BaseException as exc:  # noqa: BLE001 - every request in the batch gets the engine's error
            _quietly(lambda: engine.abort(list(running)))
            for r in {id(r): r for r, _ in running.values()}.values():
                r.done.set_exception(exc)
            running.clear()
            return
        for rid, gen in ended:
            r, i = running.pop(rid)
            gen.version = engine.version
            r.results[i] = gen
            if all(g is not None for g in r.results):
                r.done.set_result(r.results)
        gone = [rid for rid, (r, _) in running.items() if r.cancelled()]
        if gone:  # their prompts leave the batch; the others go on
            _quietly(lambda: engine.abort(gone))
            self.aborted += len(gone)
            for rid in gone:
                r, _ = running.pop(rid)
                if not r.done.done():
                    r.done.set_exception(Cancelled("the request was cancelled"))

    def _generate(self, engine, batch: list[_Generate]) -> None:
        for r in [r for r in batch if r.cancelled()]:  # cancelled while it waited: never started
            r.done.set_exception(Cancelled("the request was cancelled before it started"))
            batch.remove(r)
        if self.torn is not None:  # a load failed partway: nothing is sampled from the mix
            for r in batch:
                r.done.set_exception(self._torn_error())
            return
        if not batch:
            return
        prompts = [p for r in batch for p in r.prompts]
        self.batch_sizes.append(len(prompts))
        self.requests_merged += len(batch) if len(batch) > 1 else 0
        try:
            # one key for the batch: every request is seeded or none is
            gens = engine.generate(
                prompts,
                max_tokens=[m for r in batch for m in r.max_tokens],
                seeds=None if batch[0].seeds is None else [s for r in batch for s in r.seeds],
                **batch[0].sampling(),
            )
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the engine's error
            for r in batch:
                r.done.set_exception(exc)
            return
        for g in gens:
            g.version = engine.version
        at = 0
        for r in batch:
            r.done.set_result(gens[at : at + len(r.prompts)])
            at += len(r.prompts)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleaning up after an error already reported
        pass


def _settle(fut: Future, fn) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - the caller's thread raises it
        fut.set_exception(exc)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _unhashable(v):
    return list(v) if isinstance(v, tuple) else v
