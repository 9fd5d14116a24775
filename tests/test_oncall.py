"""`long/oncall-v0`: the long-horizon environment the context modes are built for (envs/oncall.py)."""

from __future__ import annotations

import pytest

import envs
from envs.tool_calls import format_tool_call as call


def test_the_chain_is_followed_and_the_report_must_name_every_failing_service():
    env = envs.make("long/oncall-v0", horizon=12)
    task, _ = env.reset(seed=4)
    # only the first is named
    assert env.services[0] in task and all(s not in task for s in env.services[1:])
    seen = []
    for i, name in enumerate(env.services):
        obs, reward, done, _, info = env.step(call("check", service=name))
        nxt = env.services[i + 1] if i + 1 < len(env.services) else None
        assert obs.endswith(f"Next: {nxt}.") if nxt else obs.endswith("End of the chain.")
        assert obs.startswith("FAILING " if name in env.failing else "ok "), obs
        seen += [m["name"] for m in info["milestones"]]
        assert not done
    assert seen == [f"found:{s}" for s in env.failing]
    # a report missing one failing service: the named ones pay, no solved
    obs, reward, done, _, info = env.step(call("report", failing=", ".join(env.failing[1:])))
    assert done and "1 failing service(s) missing" in obs
    assert {m["name"] for m in info["milestones"]} == {f"named:{s}" for s in env.failing[1:]}
    env.reset(seed=4)
    healthy = next(s for s in env.services if s not in env.failing)
    _, reward, _, _, info = env.step(call("report", failing=", ".join(env.failing + [healthy])))
    # naming a healthy service earns none of the named ones
    assert reward == 0 and info["milestones"] == []
    env.reset(seed=4)
    _, reward, _, _, info = env.step(call("report", failing="; ".join(reversed(env.failing))))
    assert reward == pytest.approx(0.75) and "solved" in {m["name"] for m in info["milestones"]}
    env.close()


def test_the_failing_services_are_spread_over_the_whole_chain():
    """What is found first is needed last: a failing service in every quarter of the chain."""
    env = envs.make("long/oncall-v0", horizon=[16, 32, 48])
    horizons = set()
    for seed in range(12):
        env.reset(seed=seed)
        horizons.add(env.horizon)
        where = [env.services.index(s) for s in env.failing]
        assert all(
            any(q * env.horizon // 4 <= i < (q + 1) * env.horizon // 4 for i in where)
            for q in range(4)
        )
        assert len(env.failing) < env.horizon
    assert horizons == {16, 32, 48}  # each episode draws its horizon from the list, by its seed
    env.close()


def test_a_service_name_is_an_argument_never_a_command():
    env = envs.make("long/oncall-v0", horizon=4)
    env.reset(seed=1)
    for hostile in (
        "billing; touch /workspace/pwned",
        "$(touch /workspace/pwned)",
        "../../etc/passwd",
    ):
        obs, _, _, _, info = env.step(call("check", service=hostile))
        assert obs.startswith("error: no service") and info["failures"] == ["tool_error"]
    assert not (env.sandbox.path / "pwned").exists()
    env.close()


def test_bad_kwargs_are_named_when_the_config_loads():
    from rl.config import ConfigError, load_config

    for kwargs, words in (
        ("{horizon: 1}", "horizon must be an integer"),
        ("{horizon: [8, 100]}", "from 2 to 64"),
        ("{horizon: 8, max_turns: -1}", "max_turns must be an integer >= 0"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config(None, ["env.id=long/oncall-v0", f"env.kwargs={kwargs}"])
    assert envs.config_problem("long/oncall-v0", {"horizon": [8, 16]}) is None
