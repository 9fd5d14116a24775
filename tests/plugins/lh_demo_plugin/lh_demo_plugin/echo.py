"""`demo/echo-v0`: say the secret word back through the `say` tool (milestone `echoed`, 1.0).

The README's "Your own environment" shows this file verbatim after this docstring (tests/test_docs.py)."""

from envs import Milestone, ToolEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call

SAY = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}


class EchoEnv(ToolEnv):
    # what the model is told it can call: a name, a description, a JSON schema of the arguments
    tools = [ToolSpec("say", "Say a word; ends the episode.", SAY)]
    # what it can be paid for (`envs show` lists these; `envs check` fails on an undeclared one)
    milestones = (Milestone("echoed", 1.0, "said the word the task asked for"),)

    def __init__(self, max_turns: int = 2):  # keyword arguments are env.kwargs in a run config
        super().__init__()
        self.max_turns = max_turns

    def _reset_task(self) -> str:  # the task text; draw from self.np_random (seeded by reset)
        self.word = ["apple", "river"][int(self.np_random.integers(2))]
        return f"Say the word {self.word}."

    def tool_functions(self):  # tool name -> function of the call's arguments
        return {"say": self._say}

    def _say(self, word: str) -> str:  # returns the observation the model reads next
        if not word.isalpha():
            # an error observation; the turn's failure kind is `tool_error`
            raise ToolFailure("a word has letters only")
        self.finish()  # ends the episode after this turn
        if word == self.word:
            self.reach("echoed", 1.0)  # pays the milestone (once per episode)
            return "right"
        return "wrong"

    def expert_turns(self):  # turns that solve the current task, as a model writes them
        # the warm start and `envs check` play these
        return [format_tool_call("say", word=self.word)]
