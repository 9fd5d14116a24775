"""`demo/words-v0`: `demo/echo-v0` over a word list chosen by a keyword argument, whose value the
class checks itself (`kwargs_problem`), so a misspelt list stops a run when its config loads.

docs/environments.md shows the `kwargs_problem` below verbatim (tests/test_docs.py)."""

from lh_demo_plugin.echo import EchoEnv

WORDS = {"fruit": ["apple", "pear"], "rivers": ["nile", "rhine"]}


class WordsEnv(EchoEnv):
    def __init__(self, words: str = "fruit", max_turns: int = 2):
        super().__init__(max_turns=max_turns)
        self.words = WORDS[words]

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        if kwargs.get("words", "fruit") not in WORDS:
            return f"words must be one of {', '.join(WORDS)}, not {kwargs['words']!r}"
        return super().kwargs_problem(kwargs)  # ToolEnv's own: max_turns

    def _reset_task(self) -> str:
        self.word = self.words[int(self.np_random.integers(len(self.words)))]
        return f"Say the word {self.word}."
