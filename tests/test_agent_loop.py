"""The agent loop: milestones, rewards and token bookkeeping with a scripted expert policy, and
the token budget with the real engine."""

import time

import pytest

import envs
import envs.calculator
from rollout.agent_loop import run_episodes
from rollout.chat import ChatFormat
from rollout.expert import ExpertEngine
from rollout.trajectory import EpisodeTask

ExpertPolicy = (
    ExpertEngine  # plays an env's scripted expert turns (a policy, not an engine stand-in)
)


def test_expert_episode_through_the_loop(tokenizer):
    chat = ChatFormat(tokenizer)
    tasks = [EpisodeTask("e0", 0, 21, 0), EpisodeTask("e1", 1, 22, 0)]
    trajs = run_episodes(
        ExpertPolicy(chat, [21, 22]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        tasks,
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    for t, seed in zip(trajs, [21, 22]):
        assert t.reward == pytest.approx(1.25) and t.stop_reason == "terminated"
        assert [(m["name"], m["turn"]) for m in t.milestones] == [("product", 0), ("solved", 2)]
        assert [m["token"] for m in t.milestones] == [
            t.turns[0].gen_end - 1,
            t.turns[2].gen_end - 1,
        ]
        assert len(t.turns) == 3 and t.turns[-1].obs_end == t.turns[-1].gen_end == len(t.token_ids)
        assert sum(t.loss_mask) == sum(turn.gen_end - turn.gen_start for turn in t.turns)
        # the token stream is exactly what the chat template renders for the whole conversation
        env = envs.make("tools/calculator-v0")
        obs, info = env.reset(seed=seed)
        messages = [{"role": "user", "content": obs}]
        for turn in env.expert_turns()[:2]:
            messages.append({"role": "assistant", "content": turn})
            messages += env.step(turn)[4]["messages"]
        messages.append({"role": "assistant", "content": env.expert_turns()[2]})
        full = tokenizer.apply_chat_template(messages, tools=info["tools"], tokenize=False)
        assert tokenizer.decode(t.token_ids, skip_special_tokens=False) + "\n" == full


@pytest.mark.slow
def test_episode_token_budget_with_the_real_engine(engine, tokenizer):
    chat = ChatFormat(tokenizer)
    env = envs.make("tools/calculator-v0")
    obs, info = env.reset(seed=5)
    prompt_len = len(chat.prompt_ids([{"role": "user", "content": obs}], info["tools"]))
    budget = prompt_len + 60
    trajs = run_episodes(
        engine,
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        [EpisodeTask(f"b{k}", 0, 5, 0) for k in range(3)],
        max_turns=6,
        max_new_tokens=40,
        max_episode_tokens=budget,
    )
    for t in trajs:
        assert len(t.token_ids) <= budget
        assert t.stop_reason in ("max_tokens", "terminated")
        # 40 sampled + a closing token at most
        assert t.turns[0].gen_end - t.turns[0].gen_start <= 41
    assert any(t.stop_reason == "max_tokens" for t in trajs)


class FlakyCalculator(envs.calculator.CalculatorEnv):
    """Fails like infrastructure does: seed 22 crashes in its second step, seed 23 in reset,
    seed 24 reports a dead sandbox through info."""

    def reset(self, *, seed=None, options=None):
        if seed == 23:
            raise OSError("sandbox could not start")
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._seed == 22 and self._turn == 1:
            raise RuntimeError("sandbox died")
        obs, r, term, trunc, info = super().step(action)
        if self._seed == 24:
            info["infra_error"] = "sandbox killed by the OOM killer"
        return obs, r, term, trunc, info


def test_environment_failures_end_only_their_episode(tokenizer):
    chat = ChatFormat(tokenizer)
    seeds = [21, 22, 23, 24]
    tasks = [EpisodeTask(f"e{s}", s, s, 0) for s in seeds]
    trajs = run_episodes(
        ExpertPolicy(chat, [21, 22, 24]),
        chat,
        FlakyCalculator,
        "test/flaky-v0",
        tasks,
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    by = {t.seed: t for t in trajs}
    assert (
        by[21].stop_reason == "terminated"
        and by[21].reward == pytest.approx(1.25)
        and not by[21].infra_error
    )
    assert (
        by[22].stop_reason == "infra_error"
        and by[22].infra_error == "step 1: RuntimeError: sandbox died"
    )
    assert len(by[22].turns) == 2
    assert by[23].stop_reason == "infra_error" and by[23].infra_error.startswith("reset: OSError")
    assert by[23].token_ids == [] and by[23].turns == []
    assert by[24].infra_error == "sandbox killed by the OOM killer" and len(by[24].turns) == 1

    # replay checks what ran before the failure, and says so of an episode that never ran
    from longhorizon.replay import replay_episode

    partial = replay_episode(by[22], make_env=envs.calculator.CalculatorEnv)
    assert partial.ok and partial.turns_checked == 1 and not partial.not_replayed
    for seed in (23, 24):
        never = replay_episode(by[seed], make_env=envs.calculator.CalculatorEnv)
        assert never.turns_checked == 0 and never.not_replayed.startswith("it never ran: ")


def test_learner_keeps_infra_failures_out_of_group_statistics():
    from rl.learner.batch import usable_episodes
    from rollout.trajectory import Trajectory

    def ep(i, group, reward, infra=""):
        return Trajectory(
            episode_id=f"e{i}",
            iteration=0,
            group_id=group,
            env_id="x",
            seed=0,
            prompt_len=1,
            token_ids=[1, 2],
            loss_mask=[0, 1],
            rollout_logprobs=[0.0, -1.0],
            reward=reward,
            infra_error=infra,
        )

    batch = [
        ep(0, 0, 1.0),
        ep(1, 0, 0.0),
        ep(2, 0, 0.0, "sandbox died"),
        ep(3, 1, 1.0),
        ep(4, 1, 0.0, "timeout"),
    ]
    kept, stats = usable_episodes(batch)
    assert [t.episode_id for t in kept] == [
        "e0",
        "e1",
    ]  # group 1 has one real episode left: dropped
    assert stats == {
        "infra_errors_dropped": 2,
        "stale_episodes_dropped": 0,
        "groups_dropped": 1,
        "groups_with_signal": 1,
        "reward_spread": 1.0,
    }  # e0 and e1 earned different rewards

    # a staleness bound: an episode with a turn older than min_version leaves too (and its group with it)
    from rollout.trajectory import Turn

    def turn(version):
        return Turn(
            gen_start=1,
            gen_end=2,
            obs_end=2,
            text="",
            observation="",
            tool_calls=0,
            tool_errors=0,
            policy_version=version,
            seed=0,
            finish_reason="stop",
        )

    fresh, stale = ep(5, 2, 1.0), ep(6, 2, 0.0)
    fresh.turns, stale.turns = [turn(3)], [turn(1)]
    kept, stats = usable_episodes([fresh, stale], min_version=2)
    assert kept == [] and stats == {
        "infra_errors_dropped": 0,
        "stale_episodes_dropped": 1,
        "groups_dropped": 1,
        "groups_with_signal": 0,
        "reward_spread": 0.0,
    }


class TamperedCalculator(envs.calculator.CalculatorEnv):
    """The same task, but a calculator that is off by one: replay must notice."""

    def _calculator(self, expression):
        return str(int(super()._calculator(expression)) + 1)


def test_replay_reproduces_expert_episodes_and_catches_a_tampered_env(tokenizer):
    from longhorizon.replay import replay_episode

    chat = ChatFormat(tokenizer)
    tasks = [EpisodeTask(f"e{s}", s, s, 0) for s in (31, 32)]
    trajs = run_episodes(
        ExpertPolicy(chat, [31, 32]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        tasks,
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    for t in trajs:
        assert t.task and t.task in tokenizer.decode(t.token_ids[: t.prompt_len])
        r = replay_episode(t)
        assert r.ok and r.turns_checked == 3, r.divergence
        bad = replay_episode(t, make_env=TamperedCalculator)
        assert not bad.ok and bad.divergence.startswith("turn 0: observation differs")
    other_task = replay_episode(trajs[0], make_env=lambda: envs.make("tools/calculator-v0"))
    assert other_task.ok
    moved = trajs[0]
    moved.seed = 99  # a different task than the one recorded
    assert replay_episode(moved).divergence.startswith("turn 0: task differs")


def test_rescoring_functions_on_an_expert_episode(tokenizer):
    from rewards.milestones import discounted, milestone_sum, terminal_only, turn_rewards

    chat = ChatFormat(tokenizer)
    (t,) = run_episodes(
        ExpertPolicy(chat, [41]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        [EpisodeTask("e41", 0, 41, 0)],
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    assert milestone_sum(t) == pytest.approx(t.reward) == pytest.approx(1.25)
    assert terminal_only(t) == 1.0
    # the product is reached on the first calculator call (turn 0), solved on the answer (turn 2)
    assert [m["turn"] for m in t.milestones] == [0, 2] and len(t.turns) == 3
    assert turn_rewards(t.milestones, len(t.turns)) == pytest.approx([0.25, 0.0, 1.0])
    assert discounted(t, 0.5) == pytest.approx(0.25 + 0.25 * 1.0)
    t.milestones = t.milestones[:1]
    assert terminal_only(t) == 0.0 and milestone_sum(t) == pytest.approx(0.25)


BUILTIN_KWARGS = {
    "tools/calculator-v0": {},
    "tools/shell-v0": {},
    "code/fix-tests-v0": {},
    "long/needle-v0": {},
    "vision/maze-v0": {"size": 5, "max_turns": 12},
    "long/oncall-v0": {"horizon": 6},
}


@pytest.mark.parametrize("env_id", sorted(BUILTIN_KWARGS))
def test_every_builtin_env_records_and_replays_through_the_loop(tokenizer, env_id):
    """The expert's episode goes through the token-in/token-out loop (tool calls decoded from ids),
    is paid in full, and replays in a fresh environment (fresh sandbox) without divergence."""
    from longhorizon.replay import replay_episode

    chat = ChatFormat(tokenizer)
    kwargs = BUILTIN_KWARGS[env_id]
    for s in (
        3,
        4,
    ):  # one episode a call: some tasks' texts repeat across seeds, and the policy matches by prompt
        (t,) = run_episodes(
            ExpertPolicy(chat, [s], env_id, **kwargs),
            chat,
            lambda: envs.make(env_id, **kwargs),
            env_id,
            [EpisodeTask(f"e{s}", s, s, 0)],
            max_turns=12,
            max_new_tokens=512,
            max_episode_tokens=16384,
        )
        assert t.stop_reason == "terminated" and t.reward == pytest.approx(
            1.25 if env_id in ("tools/calculator-v0", "long/needle-v0") else 1.0
        ), (t.stop_reason, t.milestones)
        r = replay_episode(t, kwargs)
        assert r.ok and r.turns_checked == len(t.turns), r.divergence


def test_expert_episodes_through_env_worker_actors(tokenizer, ray_cluster):
    """The same loop with each episode's environment in a slot of an EnvWorker actor."""
    from envs.env_worker import EnvWorkerActor, RemoteEnv
    from longhorizon.replay import replay_episode

    chat = ChatFormat(tokenizer)
    actor = EnvWorkerActor.options(max_concurrency=4).remote("tools/shell-v0", {})
    slots = iter(range(100))
    seeds = [5, 6]
    trajs = []
    for s in seeds:
        trajs += run_episodes(
            ExpertPolicy(chat, [s], "tools/shell-v0"),
            chat,
            lambda: RemoteEnv(actor, next(slots)),
            "tools/shell-v0",
            [EpisodeTask(f"r{s}", s, s, 0)],
            max_turns=6,
            max_new_tokens=256,
            max_episode_tokens=8192,
        )
    assert [t.reward for t in trajs] == [1.0, 1.0] and {t.stop_reason for t in trajs} == {
        "terminated"
    }
    # recorded remotely, replayed in-process: the same
    assert all(replay_episode(t).ok for t in trajs)
    assert ray_cluster.get(actor.stats.remote()) == {
        "slots": 0,
        "failures": 0,
    }  # closed after each episode
    ray_cluster.kill(actor)


def test_sandbox_events_are_recorded_stored_and_shown(tokenizer, tmp_path):
    import subprocess
    import sys

    from conftest import REPO
    from envs.tool_calls import format_tool_call as call
    from rl.store import TrajectoryStore

    chat = ChatFormat(tokenizer)
    turns = [call("bash", command="yes"), call("bash", command="echo calm"), call("submit")]
    (t,) = run_episodes(
        ExpertPolicy(chat, [1], "tools/shell-v0", turns=turns),
        chat,
        lambda: envs.make("tools/shell-v0"),
        "tools/shell-v0",
        [EpisodeTask("i0-g0-e0", 0, 1, 0)],
        max_turns=4,
        max_new_tokens=128,
        max_episode_tokens=8192,
    )
    assert any("output limit reached" in e for e in t.turns[0].sandbox_events)
    assert t.turns[1].sandbox_events == []
    TrajectoryStore(tmp_path).write("iter-000000", [t])
    (back,) = TrajectoryStore(tmp_path).trajectories()
    assert back.turns[0].sandbox_events == t.turns[0].sandbox_events
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "inspect",
            str(tmp_path),
            "--episode",
            "i0-g0-e0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "sandbox: bwrap: output limit reached" in shown.stdout, shown.stderr


class RoutingPolicy(ExpertPolicy):
    """The expert, as an engine that also reports the experts each generated token was routed to."""

    def generate(self, prompts, **kw):
        gens = super().generate(prompts, **kw)
        for g in gens:
            g.routed_experts = [
                [[tid % 8, (tid + 1) % 8], [(tid * 3) % 8, 7]] for tid in g.token_ids
            ]
        return gens


def test_routed_experts_from_the_engine_line_up_with_the_tokens(tokenizer):
    chat = ChatFormat(tokenizer)
    (t,) = run_episodes(
        RoutingPolicy(chat, [21]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        [EpisodeTask("e0", 0, 21, 0)],
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    assert len(t.routed_experts) == len(t.token_ids)
    for p, (tid, m) in enumerate(zip(t.token_ids, t.loss_mask)):
        assert t.routed_experts[p] == ([[tid % 8, (tid + 1) % 8], [(tid * 3) % 8, 7]] if m else [])
    (plain,) = run_episodes(
        ExpertPolicy(chat, [21]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        [EpisodeTask("e0", 0, 21, 0)],
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    assert plain.routed_experts is None  # an engine that records nothing leaves nothing to store


class SlowCalculator(envs.calculator.CalculatorEnv):
    """Seed 1's tool takes 2 s a step; the others answer at once. Each step's end is logged."""

    log: list = []

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._seed == 1:
            time.sleep(2.0)
        out = super().step(action)
        self.log.append((self._seed, time.perf_counter()))
        return out


@pytest.mark.slow
def test_each_episode_on_its_own_gives_the_lockstep_episodes(engine, shared, tokenizer):
    """The naive reference: lockstep over the engine driven directly. Each episode on its own thread
    through the continuously batching engine samples the same tokens (seeds are per episode and turn)."""
    chat = ChatFormat(tokenizer)
    tasks = [EpisodeTask(f"p{k}", k // 2, 30 + k, 0) for k in range(5)]
    loop = dict(max_turns=3, max_new_tokens=24, max_episode_tokens=1024, run_seed=7)
    make = lambda: envs.make("tools/calculator-v0")  # noqa: E731
    lockstep = run_episodes(engine, chat, make, "tools/calculator-v0", tasks, **loop)
    assert shared.continuous_batching
    own = run_episodes(shared, chat, make, "tools/calculator-v0", tasks, **loop)
    assert [t.episode_id for t in own] == [t.episode_id for t in lockstep]
    for a, b in zip(own, lockstep):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.reward == b.reward
        assert [(x.gen_start, x.gen_end, x.obs_end, x.seed) for x in a.turns] == [
            (x.gen_start, x.gen_end, x.obs_end, x.seed) for x in b.turns
        ]
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-4
    # one request per episode and turn, batched together by the engine
    assert shared.requests_merged > 0


@pytest.mark.slow
def test_a_slow_environment_holds_back_only_its_own_episode(shared, tokenizer):
    chat = ChatFormat(tokenizer)
    SlowCalculator.log.clear()
    tasks = [EpisodeTask(f"s{k}", k, k + 1, 0) for k in range(3)]  # seed 1 is slow
    trajs = run_episodes(
        shared,
        chat,
        SlowCalculator,
        "test/slow-v0",
        tasks,
        max_turns=3,
        max_new_tokens=16,
        max_episode_tokens=1024,
    )
    # a random policy never solves it: every episode runs 3 turns
    assert all(len(t.turns) == 3 for t in trajs)
    slow_first = min(t for seed, t in SlowCalculator.log if seed == 1)
    fast_last = max(t for seed, t in SlowCalculator.log if seed != 1)
    # the fast episodes ran all their turns during the slow one's first step
    assert fast_last < slow_first
