"""The agent loop: milestones, rewards and token bookkeeping with a scripted expert policy, and
the token budget with the real engine."""

import pytest

import envs
from rollout.agent_loop import EpisodeTask, run_episodes
from rollout.chat import ChatFormat
from rollout.vllm_engine import Generation


class ExpertPolicy:
    """Plays the calculator env's scripted expert turns, as token ids (a policy, not an engine
    stand-in: it exercises the loop's reward path that a random model never reaches)."""

    version = 0

    def __init__(self, chat, seeds):
        self.chat, self.turn = chat, 0
        self.turns = {}
        for s in seeds:
            env = envs.make("tools/calculator-v0")
            env.reset(seed=s)
            self.turns[s] = env.expert_turns()
        self.order = seeds

    def generate(self, prompts, *, max_tokens, temperature, top_p, stop_token_ids, seeds):
        out = []
        for s in self.order[: len(prompts)]:
            ids = self.chat.encode(self.turns[s][self.turn]) + [self.chat.eot_id]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        self.turn += 1
        return out


def test_expert_episode_through_the_loop(tokenizer):
    chat = ChatFormat(tokenizer)
    tasks = [EpisodeTask("e0", 0, 21, 0), EpisodeTask("e1", 1, 22, 0)]
    trajs = run_episodes(ExpertPolicy(chat, [21, 22]), chat, lambda: envs.make("tools/calculator-v0"),
                         "tools/calculator-v0", tasks, max_turns=5, max_new_tokens=64, max_episode_tokens=4096)
    for t, seed in zip(trajs, [21, 22]):
        assert t.reward == pytest.approx(1.25) and t.stop_reason == "terminated"
        assert [(m["name"], m["turn"]) for m in t.milestones] == [("product", 0), ("solved", 2)]
        assert [m["token"] for m in t.milestones] == [t.turns[0].gen_end - 1, t.turns[2].gen_end - 1]
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
    trajs = run_episodes(engine, chat, lambda: envs.make("tools/calculator-v0"), "tools/calculator-v0",
                         [EpisodeTask(f"b{k}", 0, 5, 0) for k in range(3)],
                         max_turns=6, max_new_tokens=40, max_episode_tokens=budget)
    for t in trajs:
        assert len(t.token_ids) <= budget
        assert t.stop_reason in ("max_tokens", "terminated")
        assert t.turns[0].gen_end - t.turns[0].gen_start <= 41  # 40 sampled + a closing token at most
    assert any(t.stop_reason == "max_tokens" for t in trajs)
