"""`demo/echo-v0`: say the secret word back through the `say` tool (milestone `echoed`, 1.0)."""

from envs import Milestone, ToolEnv, ToolSpec
from envs.tool_calls import format_tool_call

WORDS = ["apple", "river", "stone", "cloud"]


class EchoEnv(ToolEnv):
    tools = [ToolSpec("say", "Say a word; ends the episode.",
                      {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]})]

    milestones = (Milestone("echoed", 1.0, "said the word the task asked for"),)

    def __init__(self, max_turns: int = 2):
        super().__init__()
        self.max_turns = max_turns

    def _reset_task(self) -> str:
        self.word = WORDS[int(self.np_random.integers(len(WORDS)))]
        return f"Say the word {self.word}."

    def tool_functions(self):
        return {"say": self._say}

    def _say(self, word: str) -> str:
        self.finish()
        if word == self.word:
            self.reach("echoed", 1.0, self._events)
            return "right"
        return "wrong"

    def expert_turns(self):
        return [format_tool_call("say", word=self.word)]
