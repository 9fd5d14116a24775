"""The locally built tokenizer and chat template, and the agent loop's token-level rendering."""

from envs.calculator import CalculatorEnv
from rollout.chat import ChatFormat


def _conversation():
    env = CalculatorEnv()
    obs, info = env.reset(seed=2)
    turns = env.expert_turns()
    _, _, _, _, step = env.step(turns[0])
    return info["tools"], obs, turns[0], step["messages"]


def test_observation_tokens_continue_a_full_render(tokenizer):
    chat = ChatFormat(tokenizer)
    tools, obs, turn, obs_messages = _conversation()
    prompt = chat.prompt_ids([{"role": "user", "content": obs}], tools)
    generated = chat.encode(turn) + [chat.eot_id]
    ids = prompt + generated + chat.observation_ids(obs_messages)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": obs}, {"role": "assistant", "content": turn}, *obs_messages],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(ids, skip_special_tokens=False) == full
    assert full.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_renders_tools_and_structured_tool_calls(tokenizer):
    tools, obs, _, _ = _conversation()
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": obs},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "calculator", "arguments": {"expression": "2*3"}},
                    }
                ],
            },
            {"role": "tool", "content": "6"},
        ],
        tools=tools,
        tokenize=False,
    )
    assert '"name": "calculator"' in text and "<tools>" in text
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\n6\n</tool_response>" in text


def test_tool_tags_are_single_tokens_that_survive_decoding(tokenizer):
    chat = ChatFormat(tokenizer)
    ids = chat.encode("<tool_call>")
    assert len(ids) == 1
    assert chat.decode(ids + [chat.eot_id]) == "<tool_call>"


def test_an_expert_tool_call_is_written_as_the_template_renders_it(tokenizer):
    """Warm-start demonstrations are written with `format_tool_call`; the chat template renders the
    same call from a structured message. Non-ASCII arguments must come out identical (json.dumps
    would write "\\u2713" where the template writes "✓", so the demonstration would tokenise
    differently from what the policy sees)."""
    from envs.tool_calls import format_tool_call

    tools, obs, _, _ = _conversation()
    args = {"answer": "done ✓ — 5 °C, naïve"}
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": obs},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "submit", "arguments": args}}
                ],
            },
        ],
        tools=tools,
        tokenize=False,
    )
    written = format_tool_call("submit", **args)
    assert "✓" in written and "\\u" not in written
    assert written in text
