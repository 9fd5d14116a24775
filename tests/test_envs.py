"""The calculator environment, the tool-call parser and the registry."""

import pytest

import envs
from envs.base import ToolFailure
from envs.calculator import CalculatorEnv, evaluate
from envs.tool_calls import parse_tool_calls


def test_expert_solves_with_two_milestones():
    env = envs.make("tools/calculator-v0")
    obs, info = env.reset(seed=3)
    assert {t["function"]["name"] for t in info["tools"]} == {"calculator", "submit"}
    total, names = 0.0, []
    for turn in env.expert_turns():
        obs, reward, terminated, truncated, info = env.step(turn)
        total += reward
        names += [m["name"] for m in info["milestones"]]
        assert info["tool_errors"] == 0
    assert terminated and not truncated
    assert names == ["product", "solved"] and total == pytest.approx(1.25)


def test_reward_only_at_milestones_and_wrong_answer_ends_unpaid():
    env = CalculatorEnv()
    env.reset(seed=5)
    _, r, term, _, info = env.step(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    )
    assert r == 0.0 and not term and info["messages"][0]["content"] == "2"
    _, r, term, _, info = env.step(
        f'<tool_call>{{"name": "submit", "arguments": {{"answer": {env.answer + 1}}}}}</tool_call>'
    )
    assert r == 0.0 and term and info["messages"][0]["content"] == "incorrect"
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("anything")


def test_same_seed_same_task_and_different_seeds_differ():
    a, b = CalculatorEnv(), CalculatorEnv()
    assert a.reset(seed=11)[0] == b.reset(seed=11)[0]
    assert len({CalculatorEnv().reset(seed=s)[0] for s in range(20)}) > 15


def test_malformed_and_unknown_calls_become_error_observations():
    env = CalculatorEnv(max_turns=3)
    env.reset(seed=0)
    _, r, term, trunc, info = env.step(
        '<tool_call>{"name": calculator, oops</tool_call> and <tool_call>{"name": "rm"}</tool_call>'
    )
    assert r == 0 and not term and not trunc
    assert info["tool_errors"] == 2
    contents = [m["content"] for m in info["messages"]]
    assert contents[0].startswith("error: malformed tool call")
    assert "unknown tool 'rm'" in contents[1]
    _, _, _, _, info = env.step(
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    )
    # checked against the tool's schema: what it takes, never the Python error a bad call would raise
    assert info["tool_errors"] == 1 and info["failures"] == ["tool_error"]
    assert info["messages"][0]["content"] == (
        'error: calculator: missing expression; unknown argument "expr". '
        "Call it as calculator(expression: string)"
    )
    _, _, term, trunc, info = env.step("no tools here")
    assert info["messages"][0]["role"] == "user" and trunc and not term


@pytest.mark.parametrize(
    "expr", ["2**999999", "__import__('os').system('id')", "9" * 300, "1/0", "[1]*10**9", "x"]
)
def test_calculator_refuses_hostile_expressions(expr):
    with pytest.raises(ToolFailure):
        evaluate(expr)


def test_calculator_bounds_huge_products():
    with pytest.raises(ToolFailure, match="too large"):
        evaluate("*".join(["99999"] * 10))
    assert evaluate("(12 + 3) * 4 - 10 / 4") == 57.5
    assert evaluate(" 2696 * 12\n") == 32352  # surrounding whitespace, as models write it
    assert evaluate("6 / 3") == 2 and isinstance(evaluate("6 / 3"), int)


def test_tool_call_parser_is_tolerant():
    calls, errors = parse_tool_calls(
        'think <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
        "<tool_call>{'name': 'b', 'arguments': '{\"y\": 2}'}</tool_call>"
        '<tool_call>```json\n{"name": "c"}\n```</tool_call>'
        '<tool_call>{"name": "d", "arguments": {}}'  # unclosed at the end of the turn
    )
    assert [(c.name, c.arguments) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
        ("c", {}),
        ("d", {}),
    ]
    assert errors == []
    calls, errors = parse_tool_calls(
        '<tool_call>[1, 2]</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "e", "arguments": [1]}</tool_call>'
    )
    assert calls == [] and [e.message for e in errors] == [
        "tool call is not a JSON object",
        'tool call has no "name" string',
        "\"arguments\" of 'e' is not an object",
    ]
    assert parse_tool_calls("plain text") == ([], [])


def test_registry_errors_and_plugin_style_registration():
    with pytest.raises(KeyError, match="unknown environment 'tools/nope-v0'.*tools/calculator-v0"):
        envs.make("tools/nope-v0")
    with pytest.raises(ValueError, match="namespace/name-v0"):
        envs.register("calculator", "envs.calculator:CalculatorEnv")
    envs.register("test/short-calculator-v1", "envs.calculator:CalculatorEnv", max_turns=1)
    env = envs.make("test/short-calculator-v1")
    assert env.max_turns == 1
    assert envs.make("test/short-calculator-v1", max_turns=5).max_turns == 5


@pytest.mark.parametrize(
    "env_id",
    [
        s.id
        for s in envs.list_specs()
        if s.entry_point.startswith("envs.") and not envs.is_agent_program(envs.env_class(s.id))
    ],
)
def test_gymnasium_check_env_passes_and_gymnasium_make_knows_the_id(env_id):
    """Gymnasium's own checker (spaces, seeding determinism, API) on every built-in environment,
    made through Gymnasium's registry."""
    import gymnasium
    from gymnasium.utils.env_checker import check_env

    env = gymnasium.make(env_id)
    try:
        assert isinstance(env.unwrapped, envs.env_class(env_id))
        check_env(env.unwrapped, skip_render_check=True)
        obs, info = env.reset(seed=3)
        assert env.observation_space.contains(obs) and "tools" in info
    finally:
        env.unwrapped.close() if hasattr(env.unwrapped, "close") else None


def test_actions_are_text_and_bytes_are_decoded():
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, _, _, _, info = env.step(b'<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert "unknown tool 'nope'" in obs and info["tool_errors"] == 1
    with pytest.raises(TypeError, match="got int"):
        env.step(7)


def test_envs_check_holds_an_environment_to_the_typed_step_info():
    """`envs.StepInfo` is the contract with the agent loop: an environment whose step leaves out a
    key the loop needs is named by `check_env`, key by key; the built-in one passes."""
    from envs.base import StepInfo
    from envs.check import EnvCheckError, check_env

    class Forgetful(CalculatorEnv):
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return (
                obs,
                reward,
                terminated,
                truncated,
                {k: v for k, v in info.items() if k != "milestones"},
            )

    assert StepInfo.__required_keys__ == {"messages", "milestones", "tool_errors"}
    with pytest.raises(EnvCheckError) as err:
        check_env(Forgetful(max_turns=4))
    assert "expert turn 0: info lacks milestones (envs.StepInfo says what each is)" in str(
        err.value
    )
    check_env(CalculatorEnv(max_turns=4))
