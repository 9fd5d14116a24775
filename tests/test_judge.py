"""LLM-as-judge reward parts (rewards/judge.py, rollout/judge_actor.py): what the judge is asked, how its
log-probs become a score, the score cache, the judged incident environment; on the real engine, a
judge that ranks a good report above bad ones, a cache that answers without an engine, a dead judge
that turns into infrastructure errors, and a training run whose judge scores `replay --rescore`
reproduces."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

import envs
from conftest import REPO, started_trainer
from envs.tool_calls import format_tool_call as call
from rewards.judge import LETTERS, Judge, JudgeCache, likelihood_score, rank_scores, verdict_score
from rewards.rubric import build
from rollout.judge_actor import apply_rubric, ask, ask_groups, settle
from rollout.trajectory import Trajectory, Turn

QUESTION = "Question: Which service failed, with what error, and since when?"
LIKELIHOOD = {"fn": "judge", "kwargs": {"mode": "likelihood", "criteria": QUESTION}}


def _report_episode(report: str, seed: int = 3, episode_id: str = "e0") -> Trajectory:
    env = envs.make("text/incident-v0")
    task, _ = env.reset(seed=seed)
    text = call("submit", report=report)
    obs, reward, *_ = env.step(text)
    turns = [Turn(0, 5, 10, text, obs, 1, 0, 0, 0, "stop")]
    return Trajectory(
        episode_id,
        0,
        0,
        "text/incident-v0",
        seed,
        0,
        list(range(10)),
        [1] * 10,
        [0.0] * 10,
        turns=turns,
        task=task,
        milestones=[{"name": "reported", "reward": reward, "turn": 0, "token": 5}]
        if reward
        else [],
        reward=reward,
    )


def _good_and_bad(seed: int = 3) -> list[Trajectory]:
    env = envs.make("text/incident-v0")
    env.reset(seed=seed)
    good = f"Incident: the {env.service} service fails with '{env.error}' since {env.since}."
    other = next(s for s in envs.incident.SERVICES if s != env.service)
    return [
        _report_episode(good, seed, "good"),
        _report_episode(f"The {env.service} service had some errors today.", seed, "vague"),
        _report_episode(f"Incident: {other} ran out of memory at 17:00 today.", seed, "wrong"),
        _report_episode("I do not know what happened here.", seed, "none"),
    ]


def test_the_judge_is_asked_about_the_task_and_the_answer():
    t = _report_episode("Incident: billing is down since 09:00 today.")
    v = Judge(criteria="Names the failing service.").request(t, "The billing service failed.")
    assert v.mode == "verdict" and v.messages[0][0] == "system"
    user = v.messages[1][1]
    assert (
        t.task in user
        and "billing is down" in user
        and "A reference answer:\nThe billing service failed." in user
    )
    assert "Names the failing service." in user and user.endswith("Answer Yes or No.")
    lk = Judge(criteria=QUESTION, mode="likelihood").request(t, "The billing service failed.")
    assert lk.target == " The billing service failed." and lk.prompt.endswith(
        "Answer according to the agent:"
    )
    with pytest.raises(ValueError, match="needs the environment's reference answer"):
        Judge(criteria=QUESTION, mode="likelihood").request(t, "")
    # the transcript shows every turn and its observation; the end of a long one is kept
    t.turns = t.turns * 3
    long = Judge(criteria="x", show="transcript", max_chars=120).answer(t)
    assert long.startswith("…") and len(long) == 121 and long.endswith("report received")
    assert "[turn 0] agent:" in Judge(criteria="x", show="transcript").answer(t)
    # the key is the judge and everything it is asked
    assert v.key("m") == Judge(criteria="Names the failing service.").request(
        t, "The billing service failed."
    ).key("m")
    assert v.key("m") != v.key("other-model") and v.key("m") != lk.key("m")


def test_a_rank_request_labels_each_rotation_and_its_scores_undo_them():
    group = [
        _report_episode(f"Report number {i} of the group.", episode_id=f"e{i}") for i in range(3)
    ]
    r = Judge(criteria="best", mode="rank").group_request(group)
    assert (
        r.size == 3
        and len(r.chats) == 3
        and Judge(criteria="best", mode="rank", rotations=1).group_request(group).chats
        == r.chats[:1]
    )
    for rot, chat in enumerate(r.chats):
        user = chat[1][1]
        for i in range(3):  # member i is labelled LETTERS[(i - rot) % 3]
            assert f"Answer {LETTERS[(i - rot) % 3]}:\n" + group[i].turns[-1].text in user
    # a judge that only ever prefers the letter A: every member gets the same score over all rotations
    biased = [[0.0, -2.0, -2.0]] * 3
    assert rank_scores(biased) == pytest.approx([1 / 3] * 3)
    # a judge that prefers member 1 whatever its letter (letter k is member (k + r) % 3)
    prefers_1 = [[0.0 if (k + rot) % 3 == 1 else -3.0 for k in range(3)] for rot in range(3)]
    s = rank_scores(prefers_1)
    assert sum(s) == pytest.approx(1.0) and s[1] > 0.8 and s[0] == pytest.approx(s[2])
    with pytest.raises(ValueError, match="compares 1 to 26 answers"):
        Judge(criteria="x", mode="rank").group_request(group * 9)


def test_scores_from_log_probs():
    assert verdict_score(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert verdict_score(0.0, -5000.0) == 1.0 and verdict_score(-5000.0, 0.0) == pytest.approx(0.0)
    assert likelihood_score([math.log(0.5), math.log(0.125)]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        likelihood_score([])


def test_judge_parts_in_a_rubric_and_their_errors():
    rubric = build([{"fn": "milestones"}, {**LIKELIHOOD, "weight": 2.0}])
    assert [p.name for p in rubric.judges] == ["judge"] and not rubric.is_default
    t = _report_episode("Incident: billing is down since 09:00 today.")
    assert rubric.score(t, {"judge": 0.25}) == (
        pytest.approx(0.2 + 0.5),
        {"milestones": 0.2, "judge": 0.25},
    )
    with pytest.raises(ValueError, match="has no score from the judge"):
        rubric.score(t)
    # a judge part without its score makes the episode an infrastructure error, never reward 0
    failed = apply_rubric(rubric, _report_episode("x y z"))
    assert failed.failure == "infra_error" and "no score from the judge" in failed.infra_error
    for kwargs, message in [
        ({}, "criteria"),
        ({"criteria": " "}, "criteria must be a non-empty"),
        ({"criteria": "x", "mode": "vote"}, "mode must be one of verdict, likelihood"),
        ({"criteria": "x", "show": "all"}, "show must be one of"),
        ({"criteria": "x", "max_chars": 5}, "max_chars must be an integer >= 100"),
    ]:
        with pytest.raises(ValueError, match=message):
            build([{"fn": "judge", "kwargs": kwargs}])


def test_judge_config_is_checked_when_it_loads():
    from rl.config import load_config
    from typed_yaml import ConfigError

    cfg = load_config(REPO / "configs" / "quickstart_judge.yaml")
    assert cfg.env.id == "text/incident-v0" and [
        p.name for p in build(cfg.reward.parts).judges
    ] == ["judge"]
    for override, message in [
        ("env.id=tools/calculator-v0", "tools/calculator-v0 has none"),
        ("reward.judge.model=/no/such/dir", "reward.judge.model is neither a packaged model"),
        ("reward.judge.timeout_s=0", "reward.judge.timeout_s must be > 0"),
        ("reward.parts=[{fn: judge, kwargs: {mode: rank, criteria: x}}]", None),
    ]:
        # a rank judge with partial rollouts: groups would be split across iterations
        if message is None:
            with pytest.raises(ConfigError, match="rank judge compares a group"):
                load_config(
                    REPO / "configs" / "quickstart_judge.yaml",
                    [override, "rollout.iteration_token_budget=500"],
                )
            continue
        with pytest.raises(ConfigError, match=message):
            load_config(REPO / "configs" / "quickstart_judge.yaml", [override])


def test_the_cache_keeps_scores_across_processes_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "cache.jsonl"
    cache = JudgeCache(path)
    cache.put([("a", 0.5), ("b", 0.25)], "m")
    with open(path, "a") as f:
        f.write('{"key": "c", "sco')  # a write cut short by a crash
    again = JudgeCache(path)
    assert again.get("a") == 0.5 and again.get("b") == 0.25 and again.get("c") is None
    again.put([("c", 1.0)], "m")  # appended on a fresh line: the earlier lines are untouched
    assert JudgeCache(path).get("c") == 1.0 and JudgeCache(path).get("a") == 0.5
    lines = path.read_text().splitlines()
    assert (
        len(lines) == 4 and lines[2] == '{"key": "c", "sco' and json.loads(lines[3])["key"] == "c"
    )
    again.put([("d", [0.5, 0.5])], "m")  # a rank request's scores
    assert path.read_text().count("\n") == 5 and JudgeCache(path).get("d") == [0.5, 0.5]


def test_the_incident_environment():
    env = envs.make("text/incident-v0")
    report = envs.check_env(env)
    assert report["expert_milestones"] == ["found_error", "reported"]
    assert envs.env_class("text/incident-v0").succeeded([{"name": "reported"}], 0.2)
    env = envs.make("text/incident-v0", max_turns=8)
    task, _ = env.reset(seed=5)
    assert task == envs.make("text/incident-v0").reset(seed=5)[0] and "incident" in task
    assert envs.judge_reference("text/incident-v0", 5) == env.judge_reference()
    assert env.service in env.judge_reference() and env.since in env.judge_reference()
    assert envs.judge_reference("tools/calculator-v0", 5) == ""
    # bad arguments are the policy's tool errors, not crashes; a report of the wrong length is refused
    for text, error in [
        (call("read_log", start=0), "start must be from 1"),
        (call("read_log", start="x"), "start must be integer"),
        (call("grep", text=""), "non-empty"),
        (call("submit", report="too short"), "it must have 3 to 60"),
        (call("submit", report=" ".join(["w"] * 61)), "61 words"),
    ]:
        obs, reward, done, _, info = env.step(text)
        assert error in obs and reward == 0 and not done and info["failures"] == ["tool_error"]
    obs, *_ = env.step(call("read_log", start=1, count=500))
    assert len(obs.splitlines()) == 40  # at most 40 lines a call


# --- on the real engine: the packaged SmolLM2 as the judge ---


@pytest.fixture(scope="module")
def judge_path():
    from rl.start.pretrained import dense

    return str(dense("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def judge_actor(ray_cluster, judge_path, tmp_path_factory):
    """The packaged SmolLM2 as a judge in its own actor (vLLM keeps one engine per process: the
    test process may hold the session's policy engine)."""
    from rollout.judge_actor import JudgeActor

    cache = tmp_path_factory.mktemp("judge") / "judge_cache.jsonl"
    actor = JudgeActor.options(num_cpus=0.1).remote(judge_path, str(cache), name="smollm2")
    yield actor, cache
    ray_cluster.kill(actor)


@pytest.mark.slow
def test_a_real_judge_ranks_a_good_report_above_bad_ones_and_caches(judge_actor, judge_path):
    from rollout.judge_actor import JudgeScorer

    actor, cache = judge_actor
    rubric = build([{"fn": "milestones"}, LIKELIHOOD])
    trajs = [t for seed in (3, 11) for t in _good_and_bad(seed)]
    ask(rubric, trajs, actor)
    assert settle(rubric, trajs, 120)["judge/failed_episodes"] == 0
    for i in (0, 4):
        good, *bad = [t.reward_parts["judge"] for t in trajs[i : i + 4]]
        assert all(good > 3 * b for b in bad), (good, bad)
        assert 0 < min(bad) and good < 1
    assert all(
        t.reward == pytest.approx(t.reward_parts["milestones"] + t.reward_parts["judge"])
        for t in trajs
    )
    assert len(cache.read_text().splitlines()) >= len(trajs)
    # a judge on the same cache answers the same episodes without starting an engine
    again = JudgeScorer(judge_path, cache, name="smollm2")
    copies = [t for seed in (3, 11) for t in _good_and_bad(seed)]
    ask(rubric, copies, again)
    settle(rubric, copies, 60)
    assert again.engine is None and again.stats["cache_hits"] == len(copies)
    assert [t.reward_parts for t in copies] == [t.reward_parts for t in trajs]
    # another judge model (by name) is another cache entry: no stale answer from a different judge
    assert (
        JudgeScorer(judge_path, cache, name="other").cache.get(
            Judge(criteria=QUESTION, mode="likelihood").request(trajs[0], "x").key("other")
        )
        is None
    )


@pytest.mark.slow
def test_a_rank_judge_compares_a_group_and_rotations_cancel_its_position_bias(judge_actor):
    """The packaged SmolLM2 prefers the letter A whatever it labels: one order gives the episode
    shown first the top score, every rotation averaged gives each about 1/n."""
    actor, _ = judge_actor
    crit = "the report names the failing service, its error and when it started"
    one = build(
        [
            {
                "fn": "judge",
                "name": "one",
                "kwargs": {"mode": "rank", "criteria": crit, "rotations": 1},
            },
            {"fn": "judge", "name": "all", "kwargs": {"mode": "rank", "criteria": crit}},
        ]
    )
    trajs = _good_and_bad(3)
    for t in trajs:
        t.group_id = 0
    ask(one, trajs, actor)
    ask_groups(one, trajs, actor)
    assert settle(one, trajs, 120)["judge/failed_episodes"] == 0
    first_shown = sorted(trajs, key=lambda t: t.episode_id)[0]
    for name in ("one", "all"):
        assert sum(t.reward_parts[name] for t in trajs) == pytest.approx(1.0)
    assert max(trajs, key=lambda t: t.reward_parts["one"]) is first_shown
    assert all(abs(t.reward_parts["all"] - 0.25) < 0.1 for t in trajs), [
        t.reward_parts for t in trajs
    ]


@pytest.mark.slow
def test_a_dead_judge_makes_infrastructure_errors_and_a_restarted_one_scores(
    ray_cluster, judge_path, tmp_path
):
    import ray

    from rollout.judge_actor import JudgeActor

    rubric = build([{"fn": "milestones"}, LIKELIHOOD])
    actor = JudgeActor.options(num_cpus=0.1, max_restarts=1).remote(
        judge_path, str(tmp_path / "c.jsonl"), name="smollm2"
    )
    first = ray.get(actor.pid.remote())
    trajs = _good_and_bad()
    # the first call starts the engine: it is still running when the actor dies
    ask(rubric, trajs, actor)
    ray.kill(actor, no_restart=False)
    settle(rubric, trajs, 120)
    assert all(
        t.failure == "infra_error" and t.infra_error.startswith("reward: judge failed: ")
        for t in trajs
    )
    assert all(t.reward_parts == {} for t in trajs)
    # Ray restarts it (calls meanwhile answer ActorUnavailableError); the next episodes are scored
    deadline = time.monotonic() + 120
    while True:
        try:
            assert ray.get(actor.pid.remote(), timeout=30) != first
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline
            time.sleep(1)
    trajs = _good_and_bad()
    ask(rubric, trajs, actor)
    assert settle(rubric, trajs, 120)["judge/failed_episodes"] == 0
    assert (
        not any(t.infra_error for t in trajs)
        and trajs[0].reward_parts["judge"] > trajs[3].reward_parts["judge"]
    )
    ray.kill(actor, no_restart=True)


@pytest.mark.slow
def test_a_run_trains_on_judge_scores_and_replay_reproduces_them(
    ray_cluster, tiny_policy, tmp_path
):
    """quickstart_judge.yaml with the tiny policy: the judge scores every episode through the loop,
    a killed judge costs an iteration's episodes (infrastructure errors) and the run goes on, and
    `replay --rescore run` gives back the stored judge scores from the cache."""
    import ray

    overrides = [
        "policy.pretrained=",
        f"policy.path={tiny_policy}",
        "lora.enabled=false",
        "warm_start.demos=0",
        "rollout.cpus_per_worker=0.1",
        "reward.judge.cpus=0.1",
        "rollout.groups_per_iteration=1",
        "rollout.group_size=4",
        "rollout.max_new_tokens=48",
        "iterations=3",
        "stop_after_flat=0",
        "stop_after_failed=0",
        "reward.judge.timeout_s=120",
    ]
    run_dir = tmp_path / "run"
    with started_trainer("quickstart_judge.yaml", overrides, run_dir) as trainer:
        first = trainer.iteration(0)
        assert (
            first["judge/failed_episodes"] == 0
            and first["infra_errors"] == 0
            and "reward/judge" in first
        )
        # for good: every judged episode of the next iteration fails
        ray.kill(trainer.judge, no_restart=True)
        dead = trainer.iteration(1)
        assert dead["infra_errors"] == dead["episodes"] == dead["judge/failed_episodes"] == 4
        # kept out of the update, not scored 0
        assert dead["episodes_trained"] == 4 and "loss" not in dead
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    from rl.store import TrajectoryStore

    stored = {t.episode_id: t for t in TrajectoryStore(run_dir).trajectories()}
    judged = [t for t in stored.values() if not t.infra_error]
    assert len(judged) == 4 and all(0 < t.reward_parts["judge"] < 1 for t in judged)
    assert all("judge failed" in t.infra_error for t in stored.values() if t.iteration == 1)
    assert len((run_dir / "judge_cache.jsonl").read_text().splitlines()) == 4
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "replay",
            str(run_dir),
            "--all",
            "--rescore",
            "run",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rescored = {row["episode_id"]: row for row in json.loads(r.stdout)}
    # the failed ones were never judged
    assert "judge: 8 of 8 scores from the run's cache" not in r.stderr
    assert "judge: 4 of 8 scores from the run's cache" in r.stderr
    for t in judged:
        assert rescored[t.episode_id]["parts"] == t.reward_parts
        assert rescored[t.episode_id]["rescored"] == pytest.approx(t.reward)
