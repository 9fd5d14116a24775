"""SharedEngine (rollout/engines/shared.py): one engine on a thread of its own, serving callers on
any thread. Concurrent generate requests share one engine call and get exactly what one plain
call of the same prompts gives (the naive reference: the engine driven directly); other calls run
alone and in order, so a load never lands inside a batch and every generation says which version
sampled it; an engine's error reaches its caller and leaves the thread serving."""

import threading
import time

import pytest

from rollout.engines.shared import SharedEngine
from rollout.weights import CheckpointTensors

pytestmark = pytest.mark.slow


@pytest.fixture
def shared(engine):
    """The session's engine, driven by a SharedEngine's thread for the test (vLLM allows one engine
    per process); handed back to the main thread afterwards."""
    s = SharedEngine(lambda: engine)
    yield s
    s.close()


def _hold(shared, seconds: float) -> threading.Thread:
    """Keep the engine's thread busy, so that requests made meanwhile queue up together."""
    t = threading.Thread(target=shared.call, args=(lambda _: time.sleep(seconds),))
    t.start()
    time.sleep(0.05)
    return t


def test_concurrent_requests_share_one_call_and_get_what_one_plain_call_gives(engine, shared):
    prompts = [[5 + i, 17, 33, 2 + i] for i in range(6)]
    seeds = [100 + i for i in range(6)]
    reference = engine.generate(prompts, max_tokens=12, temperature=1.0, seeds=seeds)  # driven directly

    results: dict[int, list] = {}

    def ask(k: int) -> None:
        results[k] = shared.generate(prompts[2 * k : 2 * k + 2], max_tokens=12, temperature=1.0,
                                     seeds=seeds[2 * k : 2 * k + 2])

    hold = _hold(shared, 0.5)
    askers = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
    for t in askers:
        t.start()
    for t in [hold, *askers]:
        t.join()
    assert shared.batch_sizes == [6] and shared.requests_merged == 3  # three requests, one engine call
    got = results[0] + results[1] + results[2]
    assert [g.token_ids for g in got] == [r.token_ids for r in reference]
    assert max(abs(a - b) for g, r in zip(got, reference) for a, b in zip(g.logprobs, r.logprobs)) < 1e-6
    assert {g.version for g in got} == {engine.version}


def test_different_sampling_settings_are_not_merged(shared):
    hold = _hold(shared, 0.5)
    out = {}
    greedy = threading.Thread(target=lambda: out.setdefault("greedy", shared.generate([[5, 6, 7]], max_tokens=4,
                                                                                      temperature=0.0, seeds=[1])))
    sampled = threading.Thread(target=lambda: out.setdefault("hot", shared.generate([[5, 6, 7]], max_tokens=4,
                                                                                   temperature=1.0, seeds=[1])))
    for t in (greedy, sampled):
        t.start()
        time.sleep(0.05)
    for t in (hold, greedy, sampled):
        t.join()
    assert sorted(shared.batch_sizes) == [1, 1] and shared.requests_merged == 0
    assert len(out["greedy"]) == len(out["hot"]) == 1


def test_a_load_never_lands_inside_a_batch_and_each_generation_names_its_version(engine, tiny_policy, shared):
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


def test_an_engine_error_reaches_its_caller_and_the_thread_keeps_serving(shared):
    with pytest.raises(TypeError, match="bogus"):
        shared.generate([[5, 6]], max_tokens=2, bogus=1)
    with pytest.raises(ZeroDivisionError):
        shared.call(lambda _: 1 / 0)
    assert len(shared.generate([[5, 6]], max_tokens=2, seeds=[0])[0].token_ids) >= 1
    with pytest.raises(RuntimeError, match="no engine here"):
        SharedEngine(lambda: (_ for _ in ()).throw(RuntimeError("no engine here")))
