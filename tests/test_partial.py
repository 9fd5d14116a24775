"""Partial rollouts: episodes suspended when a call's token budget is spent continue in the next
call, token for token as if never interrupted, each turn with the version that generated it; and
the staged maximum episode length. The end-to-end run (slow) checks what the driver does with
them: only whole groups train, and every episode is stored exactly once."""

import pytest
from test_agent_loop import ExpertPolicy

import envs
from conftest import REPO
from rl.config import ConfigError, RolloutConfig, load_config
from rollout.agent_loop import continue_episodes, run_episodes
from rollout.chat import ChatFormat
from rollout.trajectory import EpisodeTask

CALC = "tools/calculator-v0"
SEEDS = [21, 22, 23, 24]


def _tasks(iteration=0):
    return [EpisodeTask(f"i{iteration}-e{k}", k // 2, s, iteration) for k, s in enumerate(SEEDS)]


def _continue(engine, chat, tasks, suspended, **kw):
    return continue_episodes(
        engine,
        chat,
        lambda: envs.make(CALC),
        CALC,
        tasks,
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
        suspended=suspended,
        **kw,
    )


def test_a_suspended_episode_continues_exactly_as_an_uninterrupted_one(tokenizer):
    chat = ChatFormat(tokenizer)
    whole = run_episodes(
        ExpertPolicy(chat, SEEDS),
        chat,
        lambda: envs.make(CALC),
        CALC,
        _tasks(),
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    engine = ExpertPolicy(chat, SEEDS)
    # a budget of one token: every call ends after one turn of every live episode
    done, suspended = _continue(engine, chat, _tasks(), None, token_budget=1, max_segments=10)
    calls, ended = 1, list(done)
    assert done == [] and len(suspended) == len(SEEDS)
    while suspended:
        engine.version += 1  # new weights between calls
        done, suspended = _continue(engine, chat, [], suspended, token_budget=1, max_segments=10)
        ended += done
        calls += 1
    assert calls == 3  # the expert solves each task in three turns
    by_id = {t.episode_id: t for t in ended}
    for ref in whole:
        t = by_id[ref.episode_id]
        assert (t.token_ids, t.loss_mask, t.rollout_logprobs) == (
            ref.token_ids,
            ref.loss_mask,
            ref.rollout_logprobs,
        )
        assert (t.reward, t.milestones, t.stop_reason) == (
            ref.reward,
            ref.milestones,
            ref.stop_reason,
        )
        assert [turn.seed for turn in t.turns] == [turn.seed for turn in ref.turns]
        # each segment records the version that generated it
        assert [turn.policy_version for turn in t.turns] == [0, 1, 2]


def test_an_episode_in_its_last_segment_runs_to_its_end_and_new_tasks_join_the_carried_ones(
    tokenizer,
):
    chat = ChatFormat(tokenizer)
    engine = ExpertPolicy(chat, SEEDS)
    first, second = _tasks()[:2], _tasks()[2:]
    done, suspended = _continue(engine, chat, first, None, token_budget=1, max_segments=2)
    assert done == [] and [ep.task.episode_id for ep in suspended] == ["i0-e0", "i0-e1"]
    engine.version = 1
    done, suspended = _continue(engine, chat, second, suspended, token_budget=1, max_segments=2)
    # the carried ones were in their second and last segment: they end whatever the budget
    assert [t.episode_id for t in done] == ["i0-e0", "i0-e1"]
    assert all(
        t.stop_reason == "terminated" and [x.policy_version for x in t.turns] == [0, 1, 1]
        for t in done
    )
    assert [ep.task.episode_id for ep in suspended] == ["i0-e2", "i0-e3"]
    assert all(len(ep.turns) == 1 for ep in suspended)  # the new ones stopped with the budget
    for ep in suspended:
        ep.env.close()


def test_an_error_closes_the_carried_environments(tokenizer):
    chat = ChatFormat(tokenizer)
    _, suspended = _continue(
        ExpertPolicy(chat, SEEDS), chat, _tasks(), None, token_budget=1, max_segments=3
    )
    closed = []
    for ep in suspended:
        ep.env.close = lambda ep=ep: closed.append(ep.task.episode_id)

    class Broken:
        version = 1

        def generate(self, *a, **k):
            raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        _continue(Broken(), chat, [], suspended, token_budget=1, max_segments=3)
    assert sorted(closed) == sorted(ep.task.episode_id for ep in suspended)


def test_staged_episode_length_schedule_and_its_validation():
    r = RolloutConfig(
        max_episode_tokens=512,
        max_model_len=4096,
        max_episode_tokens_schedule=[[0, 256], [5, 1024], [9, 4096]],
    )
    assert [r.episode_tokens_at(i) for i in (0, 4, 5, 8, 9, 100)] == [
        256,
        256,
        1024,
        1024,
        4096,
        4096,
    ]
    assert RolloutConfig(max_episode_tokens=512).episode_tokens_at(7) == 512
    for bad in ("[[5, 1024], [2, 2048]]", "[[0, 8192]]", "[[0]]", "[3, 4]", "[[0, 1.5]]"):
        with pytest.raises(ConfigError, match="rollout.max_episode_tokens_schedule"):
            load_config(
                REPO / "configs" / "quickstart.yaml", [f"rollout.max_episode_tokens_schedule={bad}"]
            )
    with pytest.raises(ConfigError, match="rollout.max_segments"):
        load_config(REPO / "configs" / "quickstart.yaml", ["rollout.max_segments=0"])


@pytest.fixture(scope="module")
def partial_run(ray_cluster, tiny_policy, tmp_path_factory):
    from rl.loop.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "iterations=4",
            f"policy.path={tiny_policy}",
            "rollout.num_workers=1",
            "rollout.groups_per_iteration=2",
            "rollout.group_size=2",
            "rollout.max_turns=4",
            "rollout.max_new_tokens=16",
            # 4 episodes × 16 tokens spend the budget in one turn: each episode is suspended after its first
            # turn and, in its second (last) segment, runs to its end with the next version
            "rollout.iteration_token_budget=40",
            "rollout.max_segments=2",
            "rollout.max_episode_tokens_schedule=[[0, 2048], [2, 420]]",
        ],
    )
    run_dir = tmp_path_factory.mktemp("partial-run")
    trainer = Trainer(cfg, run_dir)
    trainer.start()
    try:
        yield trainer.run(), run_dir
    finally:
        trainer.close()


@pytest.mark.slow
def test_partial_rollouts_through_the_loop_train_whole_groups_and_store_each_episode_once(
    partial_run,
):
    from rl.store import TrajectoryStore

    rows, run_dir = partial_run
    assert [r["episodes_trained"] for r in rows] == [
        0,
        4,
        4,
        4,
    ]  # iteration i trains the episodes of i - 1
    assert [r["episodes_suspended"] for r in rows] == [4, 4, 4, 4]
    assert all(r["stale_episodes_dropped"] == 0 for r in rows)
    assert [r["staleness_max"] for r in rows] == [0, 1, 1, 1]
    trajs = list(TrajectoryStore(run_dir).trajectories())
    ids = [t.episode_id for t in trajs]
    # iterations 0-2; iteration 3's episodes are still suspended
    assert len(ids) == len(set(ids)) == 12
    assert {t.iteration for t in trajs} == {0, 1, 2}
    for t in trajs:
        versions = [turn.policy_version for turn in t.turns]
        # first segment with the weights of its iteration, the rest with the next version
        assert versions[0] == t.iteration and set(versions[1:]) <= {t.iteration + 1}, versions
    # the staged schedule: episodes started from iteration 2 on are limited to 420 tokens (prompts are ~340)
    assert all(
        len(t.token_ids) <= 420 and t.stop_reason == "max_tokens" for t in trajs if t.iteration >= 2
    )
    assert max(len(t.token_ids) for t in trajs if t.iteration < 2) > 420


def test_a_suspended_episode_continues_through_vllm_as_an_uninterrupted_one(engine, tokenizer):
    """The same continuation through the real vLLM engine (the session's, tiny random policy): each
    call ends after one turn, the next one prefills the carried context and samples the next turn
    with that turn's seed, so the episode comes out token for token as one run whole."""
    chat = ChatFormat(tokenizer)
    limits = dict(
        max_turns=3, max_new_tokens=12, max_episode_tokens=2048, temperature=1.0, run_seed=5
    )
    whole = run_episodes(engine, chat, lambda: envs.make(CALC), CALC, _tasks(), **limits)
    done, suspended = continue_episodes(
        engine,
        chat,
        lambda: envs.make(CALC),
        CALC,
        _tasks(),
        token_budget=1,
        max_segments=10,
        **limits,
    )
    calls, ended = 1, list(done)
    while suspended:
        done, suspended = continue_episodes(
            engine,
            chat,
            lambda: envs.make(CALC),
            CALC,
            [],
            suspended=suspended,
            token_budget=1,
            max_segments=10,
            **limits,
        )
        ended += done
        calls += 1
    assert calls >= 2  # at least one episode was suspended and continued
    by_id = {t.episode_id: t for t in ended}
    assert set(by_id) == {t.episode_id for t in whole}
    for ref in whole:
        t = by_id[ref.episode_id]
        assert t.token_ids == ref.token_ids and t.loss_mask == ref.loss_mask
        assert t.rollout_logprobs == pytest.approx(ref.rollout_logprobs, abs=1e-4)
        assert [turn.seed for turn in t.turns] == [turn.seed for turn in ref.turns]
        assert (t.reward, t.stop_reason) == (ref.reward, ref.stop_reason)
