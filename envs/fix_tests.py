"""`code/fix-tests-v0`: repair a small Python module until its unit tests pass.

The workspace holds `textkit.py` (four functions picked by the seed from a bank, two of them with a
planted bug) and `test_textkit.py` (one test per function). Tools: `read_file(path)`,
`write_file(path, content)`, `run_tests()` (pytest inside the sandbox), `submit()`.

Milestones (sparse): `pass:<test>` (1 / number of broken tests) the first time a test that started
out failing passes under `run_tests` (or at `submit`); nothing else is paid.

The tests are the env's, not the model's: `write_file` refuses the test file and pytest's
configuration files, and `run_tests` restores the test file and removes `conftest.py`, `pytest.ini`
and the like before each run. Not covered: model-written code runs in the same sandbox as pytest,
so code written to fool pytest itself (patching its reporting from inside the module) could.
"""

from __future__ import annotations

import re

from envs.base import SandboxedEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

# name: (correct source, buggy source, test body)
BANK = {
    "word_count": (
        "def word_count(text):\n    return len(text.split())\n",
        "def word_count(text):\n    return len(text.split(' '))\n",
        "    assert word_count('a  b\\tc') == 3\n    assert word_count('') == 0\n",
    ),
    "capitalize_words": (
        "def capitalize_words(text):\n    return ' '.join(w[:1].upper() + w[1:] for w in text.split(' '))\n",
        "def capitalize_words(text):\n    return ' '.join(w.upper() for w in text.split(' '))\n",
        "    assert capitalize_words('hello big world') == 'Hello Big World'\n",
    ),
    "is_palindrome": (
        "def is_palindrome(text):\n    s = [c.lower() for c in text if c.isalnum()]\n    return s == s[::-1]\n",
        "def is_palindrome(text):\n    return text == text[::-1]\n",
        "    assert is_palindrome('Never odd or even')\n    assert not is_palindrome('abc')\n",
    ),
    "count_vowels": (
        "def count_vowels(text):\n    return sum(c in 'aeiouAEIOU' for c in text)\n",
        "def count_vowels(text):\n    return sum(c in 'aeiou' for c in text)\n",
        "    assert count_vowels('Apple pie') == 4\n",
    ),
    "truncate": (
        "def truncate(text, n):\n    return text if len(text) <= n else text[: n - 3] + '...'\n",
        "def truncate(text, n):\n    return text if len(text) < n else text[:n] + '...'\n",
        "    assert truncate('abcdefgh', 6) == 'abc...'\n    assert truncate('abc', 3) == 'abc'\n",
    ),
    "dedupe": (
        "def dedupe(items):\n    seen = set()\n    return [x for x in items if not (x in seen or seen.add(x))]\n",
        "def dedupe(items):\n    return sorted(set(items))\n",
        "    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]\n",
    ),
}
MODULE, TESTS = "textkit.py", "test_textkit.py"
_PROTECTED = {
    TESTS,
    "conftest.py",
    "pytest.ini",
    "pyproject.toml",
    "setup.cfg",
    "tox.ini",
    "sitecustomize.py",
    "usercustomize.py",
}
_DURATION = re.compile(r" in \d+\.\d+s( \(\d+:\d\d:\d\d\))?(?=( =*)?$)", re.MULTILINE)
_RESULT = re.compile(r"^(PASSED|FAILED|ERROR) test_textkit\.py::(test_\w+)", re.MULTILINE)


class FixTestsEnv(SandboxedEnv):
    tools = [
        ToolSpec(
            "read_file",
            "Read a file of the project.",
            {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        ),
        ToolSpec(
            "write_file",
            "Replace a file of the project with new content.",
            {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        ),
        ToolSpec(
            "run_tests",
            "Run the unit tests with pytest; returns which pass.",
            {"type": "object", "properties": {}},
        ),
        ToolSpec(
            "submit",
            "Declare the fix done; ends the episode.",
            {"type": "object", "properties": {}},
        ),
    ]

    @classmethod
    # every broken test passes: the pass:* rewards add up to 1
    def succeeded(cls, milestones, reward) -> bool:
        return sum(m["reward"] for m in milestones if m["name"].startswith("pass:")) >= 1.0 - 1e-9

    milestones = (
        Milestone(
            "pass:*",
            None,
            "a test that started out failing passes (1 / number of broken tests each)",
        ),
    )

    def __init__(
        self,
        max_turns: int = 10,
        backend: str = "bwrap",
        timeout_s: float = 30.0,
        **sandbox_options,
    ):
        super().__init__(max_turns, backend, timeout_s, **sandbox_options)

    def _reset_task(self) -> str:
        rng = self.np_random
        names = sorted(BANK)
        self.functions = [names[i] for i in sorted(rng.choice(len(names), size=4, replace=False))]
        self.broken = sorted(self.functions[i] for i in rng.choice(4, size=2, replace=False))
        self.new_sandbox()
        module = "\n\n".join(BANK[f][1] if f in self.broken else BANK[f][0] for f in self.functions)
        self.sandbox.workspace.write_text(MODULE, module)
        self.test_source = f"from textkit import {', '.join(self.functions)}\n\n\n" + "\n\n".join(
            f"def test_{f}():\n{BANK[f][2]}" for f in self.functions
        )
        self.sandbox.workspace.write_text(TESTS, self.test_source)
        self.passing: dict[str, bool] = {}
        return (
            f"The project in the workspace has a module {MODULE} ({', '.join(self.functions)}) and its tests "
            f"in {TESTS}; some tests fail. "
            f"Fix {MODULE} (not the tests) so that every test passes, then call submit."
        )

    def tool_functions(self):
        return {
            "read_file": self._read_file,
            "write_file": self._write_file,
            "run_tests": self._run_tests,
            "submit": self._submit,
        }

    def _read_file(self, path: str) -> str:
        try:
            return self.sandbox.workspace.read_text(path)
        except FileNotFoundError:
            raise ToolFailure(f"no file {path!r}") from None
        except (IsADirectoryError, ValueError, OSError) as exc:
            raise ToolFailure(str(exc)) from None

    def _write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            raise ToolFailure("content must be a string")
        if path.split("/")[-1] in _PROTECTED:
            raise ToolFailure(f"{path} belongs to the test set-up and cannot be changed")
        try:
            self.sandbox.workspace.write_text(path, content)
        except (ValueError, OSError) as exc:
            raise ToolFailure(str(exc)) from None
        return f"wrote {len(content)} characters to {path}"

    def _run(self) -> tuple[dict[str, bool], str]:
        ws = self.sandbox.workspace
        for name in _PROTECTED - {TESTS}:
            p = ws.path / name
            if p.is_symlink() or p.is_file():
                p.unlink()
        (ws.path / TESTS).unlink(missing_ok=True)
        ws.write_text(TESTS, self.test_source)
        result = self.sandbox.run(
            ["python", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", TESTS]
        )
        self.record_sandbox(result)
        outcome = {f"test_{f}": False for f in self.functions}
        for status, name in _RESULT.findall(result.stdout):
            if name in outcome:
                outcome[name] = status == "PASSED"
        for f in self.broken:
            if outcome[f"test_{f}"]:
                self.reach(f"pass:test_{f}", 1.0 / len(self.broken), self._events)
        # pytest prints its run time ("2 failed in 0.31s"): dropped, so that replays compare equal
        result.stdout = _DURATION.sub("", result.stdout)
        return outcome, result.observation(max_chars=3000)

    def _run_tests(self) -> str:
        outcome, text = self._run()
        n = sum(outcome.values())
        return f"{n}/{len(outcome)} tests pass\n" + text

    def _submit(self) -> str:
        self.finish()
        outcome, _ = self._run()
        return f"submitted: {sum(outcome.values())}/{len(outcome)} tests pass"

    def expert_turns(self) -> list[str]:
        fixed = "\n\n".join(BANK[f][0] for f in self.functions)
        return [
            call("read_file", path=MODULE),
            call("run_tests"),
            call("write_file", path=MODULE, content=fixed),
            call("run_tests"),
            call("submit"),
        ]
