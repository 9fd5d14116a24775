"""The learner's malloc (rl/learner/allocator.py): its actors start with tcmalloc preloaded where the
machine has it, and the choice is checked at load time."""

from __future__ import annotations

import pytest
import ray

from conftest import REPO
from rl.config import ConfigError, load_config
from rl.learner.allocator import TCMALLOC, actor_env, tcmalloc_installed


@ray.remote(num_cpus=0)
def _malloc_of_a_fresh_worker() -> str:
    from rl.learner.allocator import in_use

    return in_use()


def test_a_learner_process_runs_with_the_allocator_asked_for(ray_cluster):
    """A Ray worker started with `actor_env` (what the trainer gives the learner actors) runs with
    tcmalloc when it is installed, glibc's malloc otherwise; `system` keeps glibc's."""
    auto = actor_env("auto")
    assert (TCMALLOC in auto.get("LD_PRELOAD", "")) == tcmalloc_installed()
    got = ray.get(
        _malloc_of_a_fresh_worker.options(runtime_env={"env_vars": auto}).remote()
        if auto
        else _malloc_of_a_fresh_worker.remote()
    )
    assert got == ("tcmalloc" if tcmalloc_installed() else "glibc")
    assert actor_env("system") == {}


def test_the_allocator_in_use_is_read_from_the_process_itself():
    """`in_use` names what the process mapped: a fresh interpreter with tcmalloc preloaded says
    tcmalloc, one without says glibc (whatever this pytest process started with)."""
    import os
    import subprocess
    import sys

    def fresh(preload: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | (
            {"LD_PRELOAD": preload} if preload else {}
        )
        out = subprocess.run(
            [sys.executable, "-c", "from rl.learner.allocator import in_use; print(in_use())"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip()

    assert fresh(None) == "glibc"
    # the Makefile's system-deps install it; a machine without is checked above
    if tcmalloc_installed():
        assert fresh(TCMALLOC) == "tcmalloc"


def test_an_ld_preload_already_set_is_kept(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    env = actor_env("tcmalloc")
    assert env["LD_PRELOAD"].split() == [TCMALLOC, "libmine.so"]


def test_asking_for_a_missing_tcmalloc_is_a_config_error(monkeypatch):
    import rl.config

    monkeypatch.setattr(rl.config, "tcmalloc_installed", lambda: False)
    with pytest.raises(
        ConfigError,
        match="learner.allocator is tcmalloc, which this machine does not have: apt-get "
        "install libtcmalloc-minimal4",
    ):
        load_config(REPO / "configs" / "quickstart.yaml", ["learner.allocator=tcmalloc"])
    assert load_config(REPO / "configs" / "quickstart.yaml", []).learner.allocator == "auto"
