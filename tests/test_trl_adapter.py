"""envs/trl_adapter.py: a tool environment inside TRL's GRPOTrainer tool loop sees what our loop sees
(the same prompt tokens, tool results and reward), so bench row 2 compares like with like."""

from __future__ import annotations

import copy
import json

import pytest

import envs
from envs.tool_calls import parse_tool_calls
from envs.trl_adapter import trl_environment, trl_prompts
from rl.start.pretrained import CHAT_TEMPLATE
from rollout.chat import ChatFormat

CALC = "tools/calculator-v0"


def _tool_envs() -> list[str]:
    out = []
    for spec in envs.list_specs():
        env_id, cls = spec.id, envs.env_class(spec.id)
        if not envs.is_agent_program(cls) and getattr(cls, "tools", None):
            out.append(env_id)
    return out


@pytest.mark.parametrize("env_id", _tool_envs())
def test_tool_schemas_are_the_environments_own(env_id):
    """What TRL renders the tools from (transformers' get_json_schema of each method) names the
    environment's tools with their descriptions, argument types and required arguments."""
    from transformers.utils import get_json_schema

    cls = envs.env_class(env_id)
    adapted = trl_environment(env_id)
    for spec in cls.tools:
        got = get_json_schema(getattr(adapted, spec.name))["function"]
        want = spec.to_openai()["function"]
        assert (got["name"], got["description"]) == (want["name"], want["description"])
        props = want["parameters"].get("properties", {})
        assert {k: v["type"] for k, v in got["parameters"]["properties"].items()} == {
            k: v["type"] for k, v in props.items()
        }
        assert set(got["parameters"].get("required", [])) == set(
            want["parameters"].get("required", props)
        )


def test_first_prompt_is_our_loops_token_for_token(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE.read_text()  # the real policy's template
    adapted = trl_environment(CALC, max_turns=4)()
    data = trl_prompts(CALC, [7, 8], max_turns=4)
    env = envs.make(CALC, max_turns=4)
    for seed, prompt in zip(data["seed"], data["prompt"]):
        obs, info = env.reset(seed=seed)
        ours = ChatFormat(tok).prompt_ids([{"role": "user", "content": obs}], info["tools"])
        theirs = tok.apply_chat_template(
            prompt,
            tools=[adapted.calculator, adapted.submit],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        assert list(theirs) == ours


def test_tool_calls_get_the_environments_results_and_reward():
    env = envs.make(CALC, max_turns=4)
    adapted = trl_environment(CALC, max_turns=4)()
    assert adapted.reset(seed=11) is None
    env.reset(seed=11)
    for turn in env.expert_turns():
        (call,), _ = parse_tool_calls(turn)
        assert getattr(adapted, call.name)(**call.arguments) == env.step(turn)[0]
    assert adapted.get_reward() == pytest.approx(1.25)  # product + solved
    assert adapted.submit(answer=0) == "error: the episode is over"  # after `submit` ended it
    assert adapted.get_reward() == pytest.approx(1.25)

    adapted.reset(seed=12)  # a fresh episode: nothing carried over
    assert adapted.get_reward() == 0.0
    assert adapted.calculator(expression="__import__('os')").startswith("error: unsupported syntax")
    assert adapted.submit(answer=-1) == "incorrect"
    assert adapted.get_reward() == 0.0


def test_grpo_trainer_trains_a_step_through_it(tiny_policy, tmp_path):
    """TRL takes the class as `environment_factory` (the tool methods as tools, `get_reward` as the
    reward source) and trains a step through it: every generation's environment is reset with its
    dataset row's seed, and the reward TRL logs is the environment's (0: a random model never
    submits the answer)."""
    import os

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    tok.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        max_completion_length=8,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    environment = trl_environment(CALC, max_turns=4)
    seeds = []

    class Watched(environment):
        def reset(self, **row):
            seeds.append(row["seed"])
            return super().reset(**row)

    Watched.__name__ = environment.__name__
    trainer = GRPOTrainer(
        model=model,
        args=args,
        processing_class=tok,
        environment_factory=Watched,
        train_dataset=Dataset.from_dict(trl_prompts(CALC, [5, 6], max_turns=4)),
    )
    assert sorted(t.__name__ for t in trainer.tools) == ["calculator", "submit"]
    assert environment.__name__ in trainer.reward_func_names
    trainer.train()
    (step, *_) = trainer.state.log_history
    assert step["step"] == 1 and len(seeds) == 2 and len(set(seeds)) == 1 and seeds[0] in (5, 6)
    assert step[f"rewards/{environment.__name__}/mean"] == 0.0 and "tools/call_frequency" in step
    json.dumps(trl_prompts(CALC, [1], max_turns=4))  # a dataset row is plain data
