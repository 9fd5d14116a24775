"""Config loading: typed, validated, errors name the key and where it came from."""

import subprocess
import sys

import pytest

from conftest import REPO
from rl.config import ConfigError, RunConfig, field_docs, load_config

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_quickstart_loads_with_types():
    cfg = load_config(QUICKSTART)
    assert isinstance(cfg, RunConfig)
    assert cfg.env.id == "tools/calculator-v0"
    assert isinstance(cfg.algo.lr, float) and cfg.algo.lr == 1e-3
    assert cfg.rollout.num_workers == 2


def test_overrides_apply_and_parse_yaml_values():
    cfg = load_config(
        QUICKSTART, ["rollout.group_size=8", "algo.lr=0.5", "env.kwargs={max_turns: 2}"]
    )
    assert cfg.rollout.group_size == 8
    assert cfg.algo.lr == 0.5
    assert cfg.env.kwargs == {"max_turns": 2}


def test_scientific_notation_without_a_dot_is_a_float():
    # YAML 1.1 reads `3e-4` as a string; a float field takes it as the number it means
    cfg = load_config(QUICKSTART, ["algo.lr=3e-4", "warm_start.lr=1E-2"])
    assert cfg.algo.lr == 3e-4 and cfg.warm_start.lr == 1e-2


def test_unknown_key_names_key_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_sze: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    msg = str(err.value)
    assert "rollout.group_sze" in msg and str(bad) in msg and "group_size" in msg


def test_wrong_type_names_key_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: algo.lr must be float, got str 'fast'"):
        load_config(bad)


def test_literal_and_range_checks(tmp_path):
    with pytest.raises(ConfigError, match="algo.loss_aggregation must be one of"):
        load_config(QUICKSTART, ["algo.loss_aggregation=sum"])
    with pytest.raises(ConfigError, match="algo.rollout_is must be one of"):
        load_config(QUICKSTART, ["algo.rollout_is=icepop"])
    with pytest.raises(ConfigError, match="algo.is_low must be in"):
        load_config(QUICKSTART, ["algo.is_low=1.5"])
    assert (
        load_config(QUICKSTART, ["algo.rollout_is=token_mask", "algo.is_low=0.5"]).algo.is_low
        == 0.5
    )
    with pytest.raises(ConfigError, match="override 'rollout.group_size=1'.*must be >= 2"):
        load_config(QUICKSTART, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load_config(QUICKSTART, ["nope=1"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(QUICKSTART, ["rollout.group_size"])
    # vLLM serves the policy/ model through the plugin: a flavour with the default engine is valid
    assert (
        load_config(QUICKSTART, ["policy.flavour=configs/policy/debug.yaml"]).rollout.engine
        == "vllm"
    )
    with pytest.raises(ConfigError, match="rollout.engine native serves the policy/ model"):
        load_config(QUICKSTART, ["rollout.engine=native"])
    both = tmp_path / "policy.yaml"
    # the warm start runs on the learner (rl/start/warm_start.py): a policy/ model is warm-started like any other
    both.write_text(
        "policy: {flavour: configs/policy/debug.yaml}\nrollout: {engine: native}\nwarm_start: {demos: 4}\n"
    )
    assert load_config(both).warm_start.demos == 4
    with pytest.raises(ConfigError, match="warm_start.demos needs learner.world_size 1"):
        load_config(QUICKSTART, ["warm_start.demos=4", "learner.world_size=2"])
    with pytest.raises(ConfigError, match="warm_start.rounds must be >= 1"):
        load_config(QUICKSTART, ["warm_start.rounds=0"])
    with pytest.raises(ConfigError, match="warm_start.patience must be >= 0"):
        load_config(QUICKSTART, ["warm_start.patience=-1"])
    with pytest.raises(
        ConfigError, match="eval.test is wrong: cell 0: stages are rl, warm_start, warm_start_more"
    ):
        load_config(QUICKSTART, ["eval.test=[{stages: [final]}]"])
    both.write_text(
        "policy: {flavour: configs/policy/debug.yaml, path: /tmp/x}\nrollout: {engine: native}\n"
    )
    with pytest.raises(ConfigError, match="policy.flavour and policy.path exclude each other"):
        load_config(both)
    with pytest.raises(
        ConfigError, match="ray.learner_resources must map resource names to non-negative amounts"
    ):
        load_config(QUICKSTART, ["ray.learner_resources={learner: -1}"])
    with pytest.raises(ConfigError, match="ray.rollout_resources must be dict"):
        load_config(QUICKSTART, ["ray.rollout_resources=3"])
    assert load_config(
        QUICKSTART, ["ray.env_worker_resources={env_worker: 0.5}"]
    ).ray.env_worker_resources == {"env_worker": 0.5}


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def _bounded_fields(cls, prefix=""):
    """(key, its Bounds, its type) for every bounded field under `cls`."""
    import dataclasses
    import typing

    from typed_yaml import bounds_of

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _bounded_fields(hints[f.name], f"{prefix}{f.name}.")
        elif bounds_of(f) is not None:
            yield f"{prefix}{f.name}", bounds_of(f), hints[f.name]


def _outside(rule, tp):
    """A value just outside `rule` (never 0 where 0 switches the feature off)."""
    step = 1 if tp is int else 0.5
    if rule.ge is not None:
        return rule.ge - step if not (rule.zero_off and rule.ge - step == 0) else rule.ge - 2 * step
    if rule.gt is not None:
        return rule.gt if not (rule.zero_off and rule.gt == 0) else rule.gt - step
    return rule.le + step if rule.le is not None else rule.lt


def test_every_bound_declared_with_a_field_is_enforced_at_load():
    """Each bounded field, set just outside its bounds on the command line, is refused naming the
    field, the rule and the override; set on its bound (where inclusive), it loads."""
    fields = list(_bounded_fields(RunConfig))
    assert len(fields) > 60  # the bounds live with the fields, not in a list in validate
    for key, rule, tp in fields:
        bad = _outside(rule, tp)
        override = f"{key}={bad}"
        assert not rule.holds(bad)
        with pytest.raises(ConfigError) as err:
            load_config(QUICKSTART, [override])
        assert str(err.value).startswith(f"command-line override {override!r}: {key} must be ")
        assert rule.text() in str(err.value)
    edges = {"algo.gamma=1.0", "rollout.group_size=2", "algo.is_low=0.0", "algo.dual_clip=0.0"}
    for override in edges:
        load_config(QUICKSTART, [override])


def test_the_policy_flavours_bounds_are_enforced_on_load(tmp_path):
    """The same for a `policy/` flavour file (configs/policy/*.yaml): each bounded size or switch
    just outside its bounds is refused naming the file and the key."""
    import yaml

    from policy.args import ModelArgs, load_model_args

    flavour = yaml.safe_load((REPO / "configs" / "policy" / "debug.yaml").read_text())
    fields = list(_bounded_fields(ModelArgs))
    assert len(fields) > 30
    for key, rule, tp in fields:
        raw = yaml.safe_load(yaml.safe_dump(flavour))
        *sections, name = key.split(".")
        node = raw
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = _outside(rule, tp)
        path = tmp_path / "flavour.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match=rf"^{path}: {key} must be "):
            load_model_args(path)


def test_a_key_that_moved_section_is_named_with_its_new_home(tmp_path):
    with pytest.raises(
        ConfigError, match=r"override 'algo.threads=1'.*'algo.threads' is now learner.threads"
    ):
        load_config(QUICKSTART, ["algo.threads=1"])
    bad = tmp_path / "old.yaml"
    bad.write_text("algo:\n  microbatch_tokens: 2048\n")
    with pytest.raises(
        ConfigError, match="old.yaml: 'algo.microbatch_tokens' is now learner.microbatch_tokens"
    ):
        load_config(bad)
    assert load_config(QUICKSTART, ["learner.threads=1"]).learner.threads == 1


def test_every_field_has_a_docstring():
    import dataclasses
    import typing

    def walk(cls) -> int:
        docs, count = field_docs(cls), 0
        for name, tp in typing.get_type_hints(cls).items():
            assert docs.get(name), f"{cls.__name__}.{name} has no docstring"
            count += 1 + (walk(tp) if dataclasses.is_dataclass(tp) else 0)
        return count

    assert walk(RunConfig) > 40


def test_cli_reports_config_error_without_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  temprature: 0.7\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "train",
            str(bad),
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert (
        "rollout.temprature" in out.stderr
        and "bad.yaml" in out.stderr
        and "temperature" in out.stderr
    )
    assert not (tmp_path / "r").exists()


def _cli(*argv: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def _one_clean_line(out: subprocess.CompletedProcess) -> str:
    """Exit 2, nothing on stdout, one line on stderr, no traceback: the line."""
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize(
    "override, key, words",
    [
        (
            "env.kwargs={bogus: 1}",
            "env.kwargs",
            ["bogus", "max_turns"],
        ),  # the constructor's own parameters
        (
            "env.id=nope/missing-v0",
            "env.id",
            ["nope/missing-v0", "tools/calculator-v0"],
        ),  # and the known ids
        ("warm_start.envs=[nope/x-v0]", "warm_start.envs", ["nope/x-v0"]),
        ("eval.env_id=tools/nothing-v0", "eval.env_id", ["tools/nothing-v0"]),
        ("env.kwargs={a: [", "env.kwargs={a: [", ["not valid YAML"]),
        (
            ("env.id=agents/command-v0", "env.kwargs={command: no-such-agent-binary}"),
            "env.id",
            [
                "cannot run on this machine",
                "'no-such-agent-binary' is not an executable program here",
            ],
        ),
        ("learner.backend=nccl", "learner.backend", ["gloo"]),
        ("policy.path=/nonexistent/model", "policy.path", ["/nonexistent/model", "no config.json"]),
        # a sandboxed environment's options: the backend's name, its own options, the values it needs
        (
            ("env.id=tools/shell-v0", "env.kwargs={backend: bwrp}"),
            "env.kwargs",
            ["unknown sandbox backend 'bwrp'", "bwrap"],
        ),
        (
            ("env.id=tools/shell-v0", "env.kwargs={runtime: runsc}"),
            "env.kwargs",
            ["bwrap sandbox does not take 'runtime'", "extra_ro"],
        ),
        (
            ("env.id=code/fix-tests-v0", "env.kwargs={timeout_s: -1}"),
            "env.kwargs",
            ["timeout_s", "> 0"],
        ),
        # a local run's environments run here: a backend this machine lacks stops it before anything starts
        (
            (
                "env.id=tools/shell-v0",
                "env.kwargs={backend: docker, docker_host: 'unix:///nonexistent/docker.sock'}",
            ),
            "env.id",
            [
                "cannot run on this machine",
                "no Docker engine reachable at unix:///nonexistent/docker.sock",
            ],
        ),
    ],
)
def test_cli_config_mistakes_stop_before_anything_starts(tmp_path, override, key, words):
    overrides = [override] if isinstance(override, str) else list(override)
    line = _one_clean_line(
        _cli("train", "configs/quickstart.yaml", *overrides, "--run-dir", str(tmp_path / "r"))
    )
    assert key in line and all(w in line for w in words), line
    assert not (tmp_path / "r").exists()


def test_cli_config_that_is_not_a_yaml_file(tmp_path):
    (tmp_path / "binary.yaml").write_bytes(b"\x80\x81\xff\x00")
    for path, words in [(tmp_path, "is a directory"), (tmp_path / "binary.yaml", "not text")]:
        line = _one_clean_line(_cli("train", str(path), "--run-dir", str(tmp_path / "r")))
        assert str(path) in line and words in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--k", "0"], "--k"),
        (["--episodes", "0"], "--episodes"),
        (["--env-kwargs", '{"x": 1}'], "does not accept"),
        (["--env-kwargs", "[1"], "not JSON"),
        (["--env", "tools/calc-v0"], "unknown environment"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (
            [
                "--env",
                "tools/shell-v0",
                "--env-kwargs",
                '{"backend": "docker", "docker_host": "unix:///no/sock"}',
            ],
            "cannot run on this machine",
        ),
    ],
)
def test_cli_eval_argument_mistakes(tmp_path, args, words):
    policy = tmp_path / "checkpoint"  # the arguments are checked before the checkpoint is read
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    argv = [
        "eval",
        str(policy),
        *(["--env", "tools/calculator-v0"] if "--env" not in args else []),
        *args,
    ]
    line = _one_clean_line(_cli(*argv))
    assert words in line, line
