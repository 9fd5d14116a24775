"""An environment whose every reset fails as infrastructure does (the fault tests' short run)."""

from envs import ToolEnv


class CrashEnv(ToolEnv):
    tools = []
    max_turns = 1

    def _reset_task(self) -> str:
        raise RuntimeError("the task server is down")

    def tool_functions(self):
        return {}
