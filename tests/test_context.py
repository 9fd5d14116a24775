"""Context management (rollout/context.py): full, window and compact through the agent loop on a
long-horizon environment, with the scripted expert (which writes the summaries) and with real
engines; every context the engine saw is a stored segment token for token; replay rebuilds the
segments; milestone credit crosses them; config errors stop a run at load."""

from __future__ import annotations

import pytest

import envs
from envs.oncall import OncallEnv
from rollout.agent_loop import continue_episodes, run_episodes
from rollout.chat import ChatFormat
from rollout.context import COMPACT_INSTRUCTION, ContextConfig
from rollout.expert import ExpertEngine
from rollout.trajectory import EpisodeTask

ENV = "long/oncall-v0"
# the tiny tokenizer spends ~70 tokens on a turn of this environment and ~500 on its prompt: at 1536
# tokens a context holds a dozen turns, and a horizon of 16 outgrows it
MODEL_LEN, AT, H = 1536, 1100, 16


class Recording:
    """An engine wrapper keeping every context it was given, with the turn it answered."""

    def __init__(self, engine):
        self.engine, self.version, self.seen = engine, 0, []

    def generate(self, prompts, **kw):
        out = self.engine.generate(prompts, **kw)
        self.seen += [(list(p), list(g.token_ids)) for p, g in zip(prompts, out)]
        return out


def expert_run(
    chat,
    mode: str,
    horizon: int = H,
    seeds=(5, 6),
    *,
    keep: int = 2,
    engine=None,
    max_episode_tokens=8000,
    **loop,
):
    kw = {"horizon": horizon}
    engine = engine or ExpertEngine(chat, list(seeds), ENV, **kw)
    tasks = [EpisodeTask(f"e{s}", i, s, 0) for i, s in enumerate(seeds)]
    ctx = ContextConfig(mode=mode, at_tokens=AT, keep_turns=keep)
    return run_episodes(
        engine,
        chat,
        lambda: envs.make(ENV, **kw),
        ENV,
        tasks,
        max_turns=horizon + 8,
        max_new_tokens=200,
        max_episode_tokens=max_episode_tokens if mode != "full" else MODEL_LEN,
        context=ctx,
        max_model_len=MODEL_LEN,
        **loop,
    )


def test_full_ends_at_the_window_and_the_managed_modes_finish(tokenizer):
    chat = ChatFormat(tokenizer)
    full = expert_run(chat, "full")
    assert all(
        t.stop_reason == "max_tokens" and t.failure == "out_of_tokens" and not t.sample_starts
        for t in full
    )
    assert all(len(t.token_ids) <= MODEL_LEN for t in full)
    for mode in ("window", "compact"):
        for t in expert_run(chat, mode):
            assert t.failure == "success" and t.context == mode and len(t.sample_starts) >= 2
            # the episode outgrew the window, each context did not
            assert len(t.token_ids) > MODEL_LEN
            assert all(e - s <= MODEL_LEN for s, e in t.sample_spans())
            summaries = [u for u in t.turns if u.kind == "summary"]
            assert (
                (len(summaries) == len(t.sample_starts) - 1) if mode == "compact" else not summaries
            )
            assert sum(u.kind == "action" for u in t.turns) == H + 1  # the checks and the report


@pytest.mark.parametrize("mode", ["window", "compact"])
def test_every_context_the_engine_saw_is_a_stored_segment(tokenizer, mode):
    chat = ChatFormat(tokenizer)
    rec = Recording(ExpertEngine(chat, [5, 6], ENV, horizon=H))
    trajs = expert_run(chat, mode, engine=rec)
    calls = {tuple(p): g for p, g in rec.seen}
    for t in trajs:
        starts = [s for s, _ in t.sample_spans()]
        for turn in t.turns:
            start = max(s for s in starts if s <= turn.gen_start)
            context = tuple(t.token_ids[start : turn.gen_start])
            assert context in calls, "a turn's stored context is not what the engine was given"
            assert calls[context] == t.token_ids[turn.gen_start : turn.gen_end]
            assert all(t.loss_mask[turn.gen_start : turn.gen_end])
        # every sampled token is trained once: in the segment that sampled it, nowhere else
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns)
        for s, e in t.sample_spans()[1:]:
            text = tokenizer.decode(t.token_ids[s:e], skip_special_tokens=False)
            assert t.task in text  # each segment restates the task
            before = [u for u in t.turns if u.gen_start < s]
            if mode == "compact":  # the segment before ended with the instruction and the summary
                assert before[-1].kind == "summary" and before[-1].text.strip() in text
                prev = before[-2]
                asked = tokenizer.decode(
                    t.token_ids[prev.gen_end : prev.obs_end], skip_special_tokens=False
                )
                assert COMPACT_INSTRUCTION in asked
            else:
                assert "are no longer shown" in text
            # kept turns: their sampled tokens, copied as prompt (mask 0) into the new segment
            kept = [u for u in before if u.kind == "action"][-2:]
            first_gen = min(u.gen_start for u in t.turns if u.gen_start >= s)
            copied = t.token_ids[s:first_gen]
            for u in kept:
                ids = t.token_ids[u.gen_start : u.gen_end]
                if any(copied[i : i + len(ids)] == ids for i in range(len(copied))):
                    break
            else:
                pytest.fail("no kept turn's tokens in the rebuilt context")
            assert not any(t.loss_mask[s:first_gen])


def test_suspended_compacting_episodes_continue_as_if_never_suspended(tokenizer):
    """Partial rollouts (a token budget per call) over compaction: the same tokens as one call."""
    chat = ChatFormat(tokenizer)
    whole = expert_run(chat, "compact")
    kw = {"horizon": H}
    engine = ExpertEngine(chat, [5, 6], ENV, **kw)
    tasks = [EpisodeTask(f"e{s}", i, s, 0) for i, s in enumerate([5, 6])]
    loop = dict(
        max_turns=H + 8,
        max_new_tokens=200,
        max_episode_tokens=8000,
        max_model_len=MODEL_LEN,
        context=ContextConfig(mode="compact", at_tokens=AT),
        token_budget=150,
        max_segments=40,
    )
    done, held, calls = [], None, 0
    while held is None or held:
        ended, held = continue_episodes(
            engine,
            chat,
            lambda: envs.make(ENV, **kw),
            ENV,
            [] if calls else tasks,
            suspended=held,
            **loop,
        )
        done += ended
        calls += 1
    assert calls > 3
    by_id = {t.episode_id: t for t in done}
    for t in whole:
        assert by_id[t.episode_id].token_ids == t.token_ids
        assert by_id[t.episode_id].sample_starts == t.sample_starts


class ShiftedOncall(OncallEnv):
    """A check whose answer reads differently from the recorded one."""

    def _check(self, service) -> str:
        return super()._check(service).replace("ERROR lines", "errors")


def test_replay_rebuilds_every_segment_and_names_where_it_departs(tokenizer, tmp_path):
    from longhorizon.replay import replay_episode
    from rl.store import TrajectoryStore
    from rollout.config import RolloutConfig

    chat = ChatFormat(tokenizer)
    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", expert_run(chat, "compact") + expert_run(chat, "window", seeds=(7,)))
    stored = list(store.trajectories())
    assert {t.context for t in stored} == {"compact", "window"}
    for t in stored:
        rollout = RolloutConfig(
            max_turns=H + 8,
            max_new_tokens=200,
            max_episode_tokens=8000,
            max_model_len=MODEL_LEN,
            context=ContextConfig(mode=t.context, at_tokens=AT),
        )
        r = replay_episode(t, {"horizon": H}, tokenizer=tokenizer, rollout=rollout)
        assert r.ok and r.turns_checked == len(t.turns), r.divergence
        with pytest.raises(ValueError, match="needs the run's tokenizer"):
            replay_episode(t, {"horizon": H})
    t = stored[0]
    bad = replay_episode(
        t, make_env=lambda: ShiftedOncall(horizon=H), tokenizer=tokenizer, rollout=rollout
    )
    assert not bad.ok and "segment" in bad.divergence
    # a summary tampered with in the record: the context built from it departs from the next call's
    summary = next(u for u in t.turns if u.kind == "summary")
    p = summary.gen_start + 2
    t.token_ids[p] = (t.token_ids[p] + 1) % len(tokenizer)
    bad = replay_episode(t, {"horizon": H}, tokenizer=tokenizer, rollout=rollout)
    assert not bad.ok and "departs from the record" in bad.divergence


def test_milestone_credit_across_segments_against_a_naive_reference(tiny_policy, tokenizer):
    """A group of compacting episodes that end differently (the expert's report, one missing a failing
    service, one naming a healthy one): the learner's advantage for every generated token, in every
    segment, is the turn's reward-to-go against the other episodes' at that turn, computed here from
    the milestones' turns alone; every milestone lies in the segment of the turn that reached it."""
    from envs.tool_calls import format_tool_call as call
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.batch import training_rows
    from rl.learner.learner import Learner

    chat = ChatFormat(tokenizer)
    env = envs.make(ENV, horizon=H)
    env.reset(seed=5)
    failing = list(env.failing)
    env.close()
    variants = [
        None,
        call("report", failing=", ".join(failing[1:])),
        call(
            "report",
            failing=", ".join(failing + [next(s for s in env.services if s not in failing)]),
        ),
    ]
    batch = []
    for k, last in enumerate(variants):
        eng = ExpertEngine(chat, [5], ENV, horizon=H)
        if last:
            eng.tasks[0].turns[-1] = last
        (t,) = expert_run(chat, "compact", seeds=[5], engine=eng)
        t.episode_id, t.group_id = f"e{k}", 0
        batch.append(t)
    assert len({t.reward for t in batch}) == 3 and all(len(t.sample_starts) >= 2 for t in batch)
    # a milestone belongs to the segment of the turn that reached it
    for row in training_rows(batch):
        for m in row.seq.milestones:
            assert 0 < m["token"] <= len(row.seq.token_ids)
    assert sum(len(r.seq.milestones) for r in training_rows(batch)) == sum(
        len(t.milestones) for t in batch
    )

    def naive(i: int) -> list[float]:
        """Per token: the reward-to-go of its turn minus the mean of the others' at that turn index."""

        def togo(t, turn):
            return sum(m["reward"] for m in t.milestones if m["turn"] >= turn)

        t, out = batch[i], [0.0] * len(batch[i].token_ids)
        for j, turn in enumerate(t.turns):
            others = [togo(o, j) for o in batch if o is not t and len(o.turns) > j]
            if not others:
                continue
            for p in range(turn.gen_start, turn.gen_end):
                out[p] = (togo(t, j) - sum(others) / len(others)) if t.loss_mask[p] else 0.0
        return out

    learner = Learner(
        tiny_policy,
        AlgoConfig(credit="milestone", scale_rewards="none"),
        LearnerConfig(threads=1),
        seed=0,
    )
    stats = learner.train_step(batch)
    for i, t in enumerate(batch):
        got = stats["annotations"][t.episode_id]["advantages"]
        assert got == pytest.approx(naive(i), abs=1e-6)
        # the summaries are trained: their tokens carry the advantage of what followed them
        for u in (u for u in t.turns if u.kind == "summary"):
            assert all(got[p] != 0.0 for p in range(u.gen_start, u.gen_end) if t.loss_mask[p])


def test_context_settings_are_checked_when_the_config_loads():
    from rl.config import ConfigError, load_config

    base = ["rollout.max_model_len=1024", "rollout.max_episode_tokens=4096"]
    with pytest.raises(
        ConfigError, match="rollout.max_model_len must be >= rollout.max_episode_tokens"
    ):
        load_config(None, base)
    cfg = load_config(
        None, base + ["rollout.context.mode=compact", "rollout.context.at_tokens=600"]
    )
    assert cfg.rollout.context.mode == "compact" and cfg.rollout.loop()["context"].at_tokens == 600
    assert (
        load_config(None, base + ["rollout.context.mode=window"]).rollout.context.threshold(1024)
        == 768
    )
    with pytest.raises(
        ConfigError, match="rollout.context.mode must be one of 'full', 'window', 'compact'"
    ):
        load_config(None, base + ["rollout.context.mode=summary"])
    with pytest.raises(ConfigError, match="rollout.context.at_tokens .*summary_tokens"):
        load_config(None, base + ["rollout.context.mode=compact", "rollout.context.at_tokens=900"])
    with pytest.raises(ConfigError, match="rollout.context.keep_turns must be >= 0"):
        load_config(None, base + ["rollout.context.mode=window", "rollout.context.keep_turns=-1"])
    with pytest.raises(ConfigError, match="unknown key 'rollout.context.keep'"):
        load_config(None, base + ["rollout.context.keep=2"])


@pytest.mark.slow
def test_compaction_with_the_vllm_engine_stores_each_segment_s_own_logprobs(
    engine, shared, tokenizer
):
    """A random policy under compact: whatever it writes, each context segment holds exactly the
    tokens it was sampled after (the engine's log-probs of the stored segment, scored again, are the
    recorded ones), in lockstep and with each episode on its own thread (the same tokens)."""
    chat = ChatFormat(tokenizer)
    tasks = [EpisodeTask(f"v{k}", k // 2, 40 + k, 0) for k in range(4)]
    kw = {"horizon": 6}
    loop = dict(
        max_turns=24,
        max_new_tokens=48,
        max_episode_tokens=8000,
        run_seed=3,
        max_model_len=MODEL_LEN,
        context=ContextConfig(mode="compact", at_tokens=AT, summary_tokens=64),
    )
    make = lambda: envs.make(ENV, **kw)  # noqa: E731
    lockstep = run_episodes(engine, chat, make, ENV, tasks, **loop)
    assert any(len(t.sample_starts) >= 2 for t in lockstep)
    for t in lockstep:
        for s, e in t.sample_spans():
            scored = [0.0] + engine.score(t.token_ids[s:e])
            gen = [p for p in range(s, e) if t.loss_mask[p]]
            assert max(abs(scored[p - s] - t.rollout_logprobs[p]) for p in gen) < 2e-3
    own = run_episodes(shared, chat, make, ENV, tasks, **loop)
    for a, b in zip(own, lockstep):
        assert a.token_ids == b.token_ids and a.sample_starts == b.sample_starts
        assert [u.kind for u in a.turns] == [u.kind for u in b.turns]


def test_inspect_replay_and_the_viewer_show_the_segments_and_summaries(
    tokenizer, tiny_policy, tmp_path
):
    """Through the command line, on a run directory: `inspect --episode` says where each context
    segment starts and shows each summary; `replay --all` rebuilds every segment with the run's
    settings; the viewer (headless Chromium) marks the summaries and the segment starts."""
    import subprocess
    import sys

    import yaml

    from conftest import REPO, chromium_flags
    from rl.config import dump_config, load_config
    from rl.store import TrajectoryStore

    chat = ChatFormat(tokenizer)
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"policy.path={tiny_policy}",
            f"env.id={ENV}",
            f"env.kwargs={{horizon: {H}}}",
            f"rollout.max_model_len={MODEL_LEN}",
            "rollout.max_episode_tokens=8000",
            f"rollout.max_turns={H + 8}",
            "rollout.max_new_tokens=200",
            "rollout.context.mode=compact",
            f"rollout.context.at_tokens={AT}",
        ],
    )
    run.mkdir()
    dump_config(cfg, run / "config.yaml")
    assert (
        yaml.safe_load((run / "config.yaml").read_text())["rollout"]["context"]["mode"] == "compact"
    )
    trajs = expert_run(chat, "compact")
    TrajectoryStore(run).write("iter-000000", trajs)
    (run / "policy-init").symlink_to(tiny_policy)

    def cli(*argv):
        return subprocess.run(
            [sys.executable, "-m", "longhorizon.cli", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )

    t = trajs[0]
    shown = cli("inspect", str(run), "--episode", t.episode_id)
    assert shown.returncode == 0, shown.stderr
    n = len(t.sample_starts)
    assert f"{n} context segments" in shown.stdout and f"context segment 2 of {n}" in shown.stdout
    assert "summary (compaction turn)" in shown.stdout
    first = next(u for u in t.turns if u.kind == "summary").text
    assert first.split(".")[0] in shown.stdout  # "Checked N of 16 services"
    replayed = cli("replay", str(run), "--all")
    assert replayed.returncode == 0 and "2 identical, 0 diverged" in replayed.stdout, (
        replayed.stdout + replayed.stderr
    )
    page = tmp_path / "viewer.html"
    assert cli("inspect", str(run), "--html", str(page)).returncode == 0
    dom = subprocess.run(
        chromium_flags() + ["--dump-dom", page.as_uri() + f"?episode={t.episode_id}"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f"context segment 2 of {n}: the context was rebuilt" in dom
    assert dom.count('class="turn summary"') == n - 1 and 'class="turn-box summary"' in dom
    assert f"{n} context segments (compact)" in dom
