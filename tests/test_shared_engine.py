"""SharedEngine (rollout/engines/shared.py): one engine on a thread of its own, serving callers on
any thread. Concurrent generate requests share the engine's batch and get exactly what one plain
call of the same prompts gives (the naive reference: the engine driven directly); with continuous
batching (the vLLM engine) a request joins a running batch and leaves it when it ends, whatever its
sampling settings; without it (an engine that can only be called: merged mode) only requests with
the same settings share a call. Other calls run alone and in order, so a load never lands inside a
batch and every generation says which version sampled it; an engine's error reaches its caller and
leaves the thread serving."""

import threading
import time

import pytest
import torch

from rollout.engines.shared import SharedEngine
from rollout.weights import CheckpointTensors

pytestmark = pytest.mark.slow


class CallOnly:
    """The session's engine without its stepping methods: a SharedEngine then merges whole calls,
    as it does for the native engine."""

    def __init__(self, engine):
        self._engine = engine
        self.generate, self.load_weights = engine.generate, engine.load_weights

    @property
    def version(self):
        return self._engine.version


@pytest.fixture
def merged(engine):
    s = SharedEngine(lambda: CallOnly(engine))
    yield s
    s.close()


def _hold(shared, seconds: float) -> threading.Thread:
    """Keep the engine's thread busy, so that requests made meanwhile queue up together."""
    t = threading.Thread(target=shared.call, args=(lambda _: time.sleep(seconds),))
    t.start()
    time.sleep(0.05)
    return t


@pytest.mark.parametrize("mode", ["continuous", "merged"])
def test_concurrent_requests_share_one_call_and_get_what_one_plain_call_gives(
    engine, request, mode
):
    shared = request.getfixturevalue("shared" if mode == "continuous" else "merged")
    assert shared.continuous_batching == (mode == "continuous")
    prompts = [[5 + i, 17, 33, 2 + i] for i in range(6)]
    seeds = [100 + i for i in range(6)]
    # driven directly
    reference = engine.generate(prompts, max_tokens=12, temperature=1.0, seeds=seeds)

    results: dict[int, list] = {}

    def ask(k: int) -> None:
        results[k] = shared.generate(
            prompts[2 * k : 2 * k + 2],
            max_tokens=12,
            temperature=1.0,
            seeds=seeds[2 * k : 2 * k + 2],
        )

    hold = _hold(shared, 0.5)
    askers = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
    for t in askers:
        t.start()
    for t in [hold, *askers]:
        t.join()
    # three requests, one engine call
    assert shared.batch_sizes == [6] and shared.requests_merged == 3
    got = results[0] + results[1] + results[2]
    assert [g.token_ids for g in got] == [r.token_ids for r in reference]
    assert (
        max(abs(a - b) for g, r in zip(got, reference) for a, b in zip(g.logprobs, r.logprobs))
        < 1e-6
    )
    assert {g.version for g in got} == {engine.version}


def test_merged_mode_keeps_different_sampling_settings_apart(merged):
    shared = merged
    hold = _hold(shared, 0.5)
    out = {}
    greedy = threading.Thread(
        target=lambda: out.setdefault(
            "greedy", shared.generate([[5, 6, 7]], max_tokens=4, temperature=0.0, seeds=[1])
        )
    )
    sampled = threading.Thread(
        target=lambda: out.setdefault(
            "hot", shared.generate([[5, 6, 7]], max_tokens=4, temperature=1.0, seeds=[1])
        )
    )
    for t in (greedy, sampled):
        t.start()
        time.sleep(0.05)
    for t in (hold, greedy, sampled):
        t.join()
    assert sorted(shared.batch_sizes) == [1, 1] and shared.requests_merged == 0
    assert len(out["greedy"]) == len(out["hot"]) == 1


def test_requests_with_different_settings_share_the_batch_and_each_gets_its_own(engine, shared):
    prompt = [5, 6, 7, 8]
    greedy_ref = engine.generate([prompt], max_tokens=8, temperature=0.0, seeds=[1])[0]
    hot_ref = engine.generate([prompt], max_tokens=8, temperature=1.0, top_p=0.9, seeds=[2])[0]
    hold = _hold(shared, 0.5)
    out = {}
    asks = [
        threading.Thread(
            target=lambda: out.setdefault(
                "greedy", shared.generate([prompt], max_tokens=8, temperature=0.0, seeds=[1])
            )
        ),
        threading.Thread(
            target=lambda: out.setdefault(
                "hot",
                shared.generate([prompt], max_tokens=8, temperature=1.0, top_p=0.9, seeds=[2]),
            )
        ),
    ]
    for t in asks:
        t.start()
        time.sleep(0.05)
    for t in (hold, *asks):
        t.join()
    assert shared.batch_sizes == [2] and shared.requests_merged == 2  # one batch, two settings
    assert (
        out["greedy"][0].token_ids == greedy_ref.token_ids
        and out["hot"][0].token_ids == hot_ref.token_ids
    )


def test_a_request_joins_a_running_batch_and_leaves_it_when_it_ends(engine, shared):
    """Continuous batching: a short request asked while a long one runs is answered long before it."""
    short_ref = engine.generate([[40, 41, 42]], max_tokens=3, min_tokens=3, seeds=[4])[0]
    ended: dict[str, float] = {}
    out: dict[str, list] = {}

    def ask(tag, prompt, n, seed):
        out[tag] = shared.generate([prompt], max_tokens=n, min_tokens=n, seeds=[seed])
        ended[tag] = time.perf_counter()

    long = threading.Thread(target=ask, args=("long", [30, 31, 32], 400, 3))
    long.start()
    deadline = time.monotonic() + 30
    while shared.batch_sizes != [1] and time.monotonic() < deadline:  # the long request is running
        time.sleep(0.005)
    ask("short", [40, 41, 42], 3, 4)
    long.join()
    # it joined the running batch
    assert shared.batch_sizes == [1, 1] and shared.requests_merged == 1
    assert ended["short"] < ended["long"] and len(out["long"][0].token_ids) == 400
    assert out["short"][0].token_ids == short_ref.token_ids


@pytest.mark.parametrize("mode", ["continuous", "merged"])
def test_a_load_never_lands_inside_a_batch_and_each_generation_names_its_version(
    engine, tiny_policy, request, mode
):
    shared = request.getfixturevalue("shared" if mode == "continuous" else "merged")
    before = engine.version
    ckpt = CheckpointTensors(tiny_policy)
    tensors = [(n, ckpt[n]) for n in ckpt.files]  # the same weights, as a new version
    order: list[str] = []
    out: dict[str, list] = {}

    def gen(tag: str) -> None:
        out[tag] = shared.generate([[9, 10, 11]], max_tokens=6, seeds=[3])
        order.append(tag)

    def load() -> None:
        shared.load_weights(iter(tensors), before + 7)
        order.append("load")

    try:
        hold = _hold(shared, 0.5)
        threads = []
        for target in (lambda: gen("old"), load, lambda: gen("new")):  # queued in this order
            threads.append(threading.Thread(target=target))
            threads[-1].start()
            time.sleep(0.05)
        for t in [hold, *threads]:
            t.join()
        assert order == ["old", "load", "new"]
        assert out["old"][0].version == before and out["new"][0].version == before + 7
        assert out["old"][0].token_ids == out["new"][0].token_ids  # the same weights, the same seed
    finally:
        engine.version = before  # other tests of the session read the engine's version


def test_busy_seconds_count_the_call_in_progress(shared):
    """The trainer's `engine_busy` metric reads them at every row: a call spanning two rows counts in both."""
    hold = _hold(shared, 0.6)
    time.sleep(0.3)
    during = shared.busy_s
    hold.join()
    assert during >= 0.3 and shared.busy_s >= 0.6 and shared.busy_s >= during


@pytest.mark.parametrize("mode", ["continuous", "merged"])
def test_an_engine_error_reaches_its_caller_and_the_thread_keeps_serving(request, mode):
    shared = request.getfixturevalue("shared" if mode == "continuous" else "merged")
    with pytest.raises(TypeError, match="bogus"):
        shared.generate([[5, 6]], max_tokens=2, bogus=1)
    with pytest.raises(Exception, match="maximum context length"):
        shared.generate([[5, 6] * 3000], max_tokens=2)  # refused by the engine as it joins
    with pytest.raises(ZeroDivisionError):
        shared.call(lambda _: 1 / 0)
    assert len(shared.generate([[5, 6]], max_tokens=2, seeds=[0])[0].token_ids) >= 1
    with pytest.raises(RuntimeError, match="no engine here"):
        SharedEngine(lambda: (_ for _ in ()).throw(RuntimeError("no engine here")))


def test_a_load_that_fails_partway_serves_nothing_until_a_load_completes(
    engine, shared, tiny_policy
):
    """A sync that dies after half its tensors leaves some layers new and the rest old: a model
    nobody trained, which the engine must not sample from under the old version's number. It
    refuses every generate and score request, naming the failed version, until a complete load."""
    from safetensors.torch import load_file

    from rollout.engines.shared import TornWeights

    original = [(n, t.numpy()) for n, t in load_file(f"{tiny_policy}/model.safetensors").items()]
    g = torch.Generator().manual_seed(5)
    moved = [
        (n, (torch.from_numpy(t) + torch.randn(t.shape, generator=g) * 0.05).numpy())
        for n, t in original
    ]

    def half_then_lost():
        yield from moved[: len(moved) // 2]
        raise ConnectionError("bucket 3 of 6 was lost")

    prompt = [5, 17, 33, 2, 40, 41, 9]
    before = shared.score(prompt)
    try:
        with pytest.raises(ConnectionError):
            shared.load_weights(half_then_lost(), version=1)
        assert shared.version == 0 and "version 1 failed partway" in shared.torn
        # what it would have served: neither version (read past the guard, on the engine's thread)
        mixed = shared.call(lambda e: e.score(prompt))
        assert max(abs(a - b) for a, b in zip(mixed, before)) > 1e-3
        for request in (
            lambda: shared.score(prompt),
            lambda: shared.generate([prompt], max_tokens=4, temperature=1.0, seeds=[1]),
        ):
            with pytest.raises(
                TornWeights, match="version 1 failed partway.*bucket 3 of 6 was lost"
            ):
                request()
        # a complete load restores it: it serves the new version, and exactly that
        shared.load_weights(iter(moved), version=1)
        assert shared.torn is None and shared.version == 1
        new = shared.score(prompt)
        assert max(abs(a - b) for a, b in zip(new, mixed)) > 1e-3
        assert (
            len(shared.generate([prompt], max_tokens=4, temperature=1.0, seeds=[1])[0].token_ids)
            == 4
        )
    finally:
        shared.load_weights(iter(original), version=0)
    assert shared.score(prompt) == before
