"""End to end on the embedded default: two iterations of the quickstart config on a local Ray
with vLLM rollout workers, a GRPO learner, weight sync and the Parquet store."""

import json
import os
import subprocess
import sys
from ipaddress import ip_address

import pytest
import ray
import torch

from conftest import REPO, chromium_dom, chromium_flags
from rl.store import TrajectoryStore
from rollout.chat import ChatFormat

pytestmark = pytest.mark.slow
TOL = 1e-3


@pytest.fixture(scope="module")
def stored(e2e_run):
    _, _, run_dir = e2e_run
    return list(TrajectoryStore(run_dir).trajectories())


def test_versions_advance_on_every_worker(e2e_run):
    trainer, rows, _ = e2e_run
    assert [r["policy_version"] for r in rows] == [1, 2]
    n_bytes = trainer.learner.call("weights")
    assert all(r["sync_bytes"] == sum(a.nbytes for _, a in n_bytes) > 0 for r in rows)
    # the fixture's small buckets: a sync in several parts
    assert all(r["sync_buckets"] > 2 for r in rows)
    # every tensor loaded straight where the engine reads it, none through vLLM's layerwise reload
    assert all(r["sync_tensors"] == r["sync_direct_tensors"] == len(n_bytes) for r in rows)
    assert [r["sync_version"] for r in rows] == [1, 2]
    assert [r["staleness_max"] for r in rows] == [
        0,
        0,
    ]  # synchronous: every token from the current weights
    assert all(r["episodes_per_s"] > 0 for r in rows)
    # synchronous: the engines generated, then idled while the learner trained and the weights moved
    assert all(0 < r["engine_busy"] < 1 for r in rows)
    assert ray.get([w.version.remote() for w in trainer.workers]) == [2] * len(trainer.workers)
    assert len(trainer.workers) == 2


def test_the_learner_actor_runs_with_tcmalloc_where_installed(e2e_run):
    from rl.learner.allocator import tcmalloc_installed

    trainer, _, _ = e2e_run
    assert trainer.learner.call("allocator") == ("tcmalloc" if tcmalloc_installed() else "glibc")


def test_environments_ran_in_the_env_worker(e2e_run, stored):
    trainer, _, _ = e2e_run
    (env_worker,) = trainer.env_workers
    # every episode's slot was closed after its episode, and none failed
    assert ray.get(env_worker.stats.remote()) == {"slots": 0, "failures": 0}
    assert all(t.stop_reason != "infra_error" for t in stored)
    assert all(t.turns and t.task for t in stored)


def test_tensorboard_events_written_as_the_run_goes(e2e_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, rows, run_dir = e2e_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("mean_reward")] == [0, 1]
    assert [e.value for e in acc.Scalars("policy_version")] == [r["policy_version"] for r in rows]


def test_learner_records_every_trained_episode(e2e_run, stored):
    _, _, run_dir = e2e_run
    store = TrajectoryStore(run_dir)
    assert [p.name for p in store.learner_shards()] == [
        "iter-000000.parquet",
        "iter-000001.parquet",
    ]
    for t in stored:
        rec = store.learner_record(t.episode_id)
        assert rec["policy_version"] == t.iteration  # the weights that generated the episode
        gen = [p for p, m in enumerate(t.loss_mask) if m]
        # before its update the learner holds the engine's weights: the same log-probs (fp32)
        assert max(abs(rec["learner_logprobs"][p] - t.rollout_logprobs[p]) for p in gen) < TOL
        assert all(rec["advantages"][p] == 0.0 for p, m in enumerate(t.loss_mask) if not m)
        # episode credit: one advantage per episode
        assert len({rec["advantages"][p] for p in gen}) == 1


def test_learner_weights_moved(e2e_run, hf_model, stored):
    trainer, _, _ = e2e_run
    ids = stored[0].token_ids
    now = torch.tensor(trainer.learner.call("logprobs", ids))
    with torch.no_grad():
        t = torch.tensor([ids])
        from rl.learner.grpo import token_logprobs

        before = token_logprobs(hf_model(input_ids=t).logits, t)[0]
    assert (now - before).abs().max().item() > 1e-2  # else the sync check below proves nothing


def test_after_sync_engines_match_learner_on_cached_prefix(e2e_run, stored):
    """Catches a missing MoE repack (wrong outputs after reload) and a stale prefix cache: the
    probe prompt shares its system/tools prefix with every rollout prompt of the last iteration,
    so that prefix sits in each engine's cache from before the last sync."""
    trainer, _, _ = e2e_run
    prompt = stored[-1].token_ids[: stored[-1].prompt_len]
    for i, worker in enumerate(trainer.workers):
        gen = ray.get(worker.generate.remote(prompt, 12, 1234 + i))
        full = prompt + gen.token_ids
        learner = torch.tensor(trainer.learner.call("logprobs", full))
        err = (learner[len(prompt) - 1 :] - torch.tensor(gen.logprobs)).abs().max().item()
        assert err < TOL, f"worker {i}: sampled-token log-probs differ from the learner's by {err}"
        scored = torch.tensor(ray.get(worker.score.remote(full)))
        assert (learner - scored).abs().max().item() < TOL


def test_loss_mask_marks_exactly_the_generated_tokens(stored, tokenizer):
    chat = ChatFormat(tokenizer)
    assert len(stored) == 2 * 16
    for t in stored:
        n = len(t.token_ids)
        assert len(t.loss_mask) == len(t.rollout_logprobs) == n
        expect = [0] * n
        for turn in t.turns:
            # the closing token we appended
            end = turn.gen_end - (1 if turn.finish_reason == "length" else 0)
            for i in range(turn.gen_start, end):
                expect[i] = 1
            if turn.finish_reason == "length":
                assert t.token_ids[turn.gen_end - 1] == chat.eot_id
            assert turn.obs_end >= turn.gen_end
        assert t.loss_mask == expect, t.episode_id
        assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m)
        for turn in t.turns:  # observations sit between turns, as tokens of the tool response
            if turn.obs_end > turn.gen_end:
                obs_text = tokenizer.decode(
                    t.token_ids[turn.gen_end : turn.obs_end], skip_special_tokens=False
                )
                assert turn.observation.split("\n")[0] in obs_text
    assert {t.turns[0].policy_version for t in stored if t.iteration == 0} == {0}
    assert {t.turns[0].policy_version for t in stored if t.iteration == 1} == {1}


def test_stored_ids_are_what_the_engine_sampled_not_a_retokenisation(engine, stored, tokenizer):
    """Regenerate version-0 turns with their recorded seeds on a fresh engine holding the same
    initial weights: the engine reproduces the stored ids, which differ from re-encoding the text."""
    chat = ChatFormat(tokenizer)
    differs = 0
    checked = 0
    for t in [t for t in stored if t.iteration == 0][:6]:
        turn = t.turns[0]
        gen = engine.generate([t.token_ids[: turn.gen_start]], max_tokens=48, seeds=[turn.seed])[0]
        stored_gen = t.token_ids[turn.gen_start : turn.gen_end]
        if turn.finish_reason == "length":
            stored_gen = stored_gen[:-1]
        assert gen.token_ids == stored_gen, t.episode_id
        assert gen.logprobs == pytest.approx(
            [
                t.rollout_logprobs[i]
                for i in range(turn.gen_start, turn.gen_start + len(stored_gen))
            ],
            abs=TOL,
        )
        checked += 1
        differs += chat.encode(chat.decode(stored_gen)) != [
            i for i in stored_gen if i != chat.eot_id
        ]
    assert checked == 6
    assert differs > 0, (
        "no turn where re-encoding the decoded text changes the ids: the test shows nothing"
    )


def test_store_metrics_and_checkpoints(e2e_run, stored):
    import datasets

    _, rows, run_dir = e2e_run
    ds = datasets.load_dataset(
        "parquet", data_files=str(run_dir / "trajectories" / "*.parquet"), split="train"
    )
    assert len(ds) == 32 and set(ds["episode_id"]) == {t.episode_id for t in stored}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    for key in ("mean_reward", "loss", "sync_s", "generated_tokens", "rollout_logprob_diff_max"):
        assert all(key in x for x in lines), key
    # learner vs engine on every generated token, before the update: initial weights, then synced ones
    assert all(x["rollout_logprob_diff_max"] < TOL for x in lines)
    # every episode's failure kind, as shares of its iteration (all kinds, zeros included)
    from rollout.trajectory import FAILURE_KINDS

    for x in lines:
        kinds = [t.failure for t in stored if t.iteration == x["iteration"]]
        assert {k: x[f"failure/{k}"] for k in FAILURE_KINDS} == {
            k: kinds.count(k) / 16 for k in FAILURE_KINDS
        }
    assert all(t.failure in FAILURE_KINDS for t in stored)
    assert (run_dir / "config.yaml").exists()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["version-000001", "version-000002"]
    assert (run_dir / "checkpoints" / "version-000002" / "tokenizer.json").exists()


def test_inspect_json_summary(e2e_run, stored):
    _, _, run_dir = e2e_run
    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    s = json.loads(out.stdout)
    assert s["iterations"] == 2 and s["episodes"] == 32
    assert len(s["mean_reward"]) == 2 and all(isinstance(x, float) for x in s["mean_reward"])
    assert s["mean_reward"][0] == pytest.approx(
        sum(t.reward for t in stored if t.iteration == 0) / 16
    )
    assert s["policy_versions"] == [0, 1]
    ep = stored[3].episode_id
    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--episode", ep],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    assert ep in out.stdout and "turn 0" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--episode", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "no episode 'nope'" in bad.stderr


def test_ray_listens_on_loopback_only(e2e_run):
    import psutil

    ray_pids = {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("ray" in part for part in (p.info["cmdline"] or [])[:3])
    }
    listening = [
        c
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ray_pids
    ]
    assert listening, "found no Ray listening sockets to check"

    def loopback(ip: str) -> bool:
        addr = ip_address(ip)
        return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback  # ::ffff:127.0.0.1 too

    outside = [(c.laddr.ip, c.laddr.port) for c in listening if not loopback(c.laddr.ip)]
    assert outside == []


def test_cli_train_then_inspect(tmp_path):
    """The user's path: `longhorizon train` in its own process (its own local Ray), then inspect."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "longhorizon.cli",
        "train",
        "configs/quickstart.yaml",
        "--run-dir",
        str(run_dir),
        "--iterations",
        "1",
        "rollout.num_workers=1",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_turns=2",
    ]
    # Ray's own default authentication (token), as a user's shell has it: the run keeps it, silently
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done" in out.stderr and str(run_dir.resolve()) in out.stderr
    assert "Token authentication" not in out.stderr and "Warning" not in out.stderr
    assert (run_dir / "policy-init" / "tokenizer.json").exists()  # made locally, nothing downloaded
    summary = json.loads(
        subprocess.run(
            [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            check=True,
        ).stdout
    )
    assert (
        summary["iterations"] == 1
        and summary["episodes"] == 4
        and summary["policy_versions"] == [0]
    )
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert again.returncode != 0 and "already holds trajectories" in again.stderr
    assert len(list((run_dir / "trajectories").glob("*.parquet"))) == 1  # nothing overwritten


def test_a_run_without_learning_signal_stops_through_the_cli(tmp_path):
    """The random policy earns nothing: with the guard on (the default outside the quickstart),
    `train` stops after the first flat iteration with exit 1 and one line that says why; the
    iteration it ran stays on disk."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "longhorizon.cli",
        "train",
        "configs/quickstart.yaml",
        "--run-dir",
        str(run_dir),
        "--iterations",
        "3",
        "stop_after_flat=1",
        "rollout.num_workers=1",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_turns=2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert (
        "the run cannot learn: 1 iterations in a row in which no group's episodes earned different rewards"
        in out.stderr
    )
    # iteration 0 ran and was written
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert len(list((run_dir / "trajectories").glob("iter-*.parquet"))) == 1


def test_replay_export_and_rescore_from_the_cli(e2e_run, stored):
    _, _, run_dir = e2e_run
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *a],
        capture_output=True,
        text=True,  # noqa: E731
        timeout=300,
        cwd=REPO,
    )
    out = run("replay", str(run_dir), "--all", "--json")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["replayed"] == 32 and res["diverged"] == 0
    assert sum(r["turns_checked"] for r in res["results"]) == sum(len(t.turns) for t in stored)
    out = run(
        "replay", str(run_dir), "--all", "--rescore", "rewards.milestones:milestone_sum", "--json"
    )
    rows = json.loads(out.stdout)
    assert [r["rescored"] for r in rows] == pytest.approx([r["recorded"] for r in rows])
    assert run("replay", str(run_dir), "--all", "--rescore", "nope:fn").returncode == 2
    out = run("export", str(run_dir), "--out", str(run_dir / "all.jsonl"))
    lines = (run_dir / "all.jsonl").read_text().splitlines()
    assert out.returncode == 0 and len(lines) == 32 and json.loads(lines[0])["episode_id"]


def test_html_viewer_renders_in_headless_chromium(e2e_run, stored):
    _, _, run_dir = e2e_run
    page = run_dir / "viewer.html"
    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = page.read_text()
    # self-contained
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text
    flags = chromium_flags()
    dom = chromium_dom(page)
    import re

    rows = re.findall(r'<tr class="episode-row(?: sel)?" data-id="(i\d+-g\d+-e\d+)"', dom)
    # the episode list, rendered by the page's script
    assert sorted(rows) == sorted(t.episode_id for t in stored)
    assert f'<h1 id="episode-title">{stored[0].episode_id}</h1>' in dom  # and the first episode
    assert 'id="timeline"' in dom and 'id="tokens"' in dom and 'id="group-title"' in dom
    # token tips carry the learner's record
    assert 'id="colour-by"' in dom and "· advantage " in dom
    # each iteration's wall time, split: four stacked parts per iteration, with the learner's seconds
    parts = re.findall(
        r'<rect class="time-part"[^>]*><title>iteration (\d+): ([a-z ]+) ([\d.]+) s</title>', dom
    )
    assert len(parts) == 4 * 2 and {p[1] for p in parts} == {
        "rollout wait",
        "learner",
        "sync",
        "other",
    }
    assert all(float(p[2]) > 0 for p in parts if p[1] == "learner")
    artifacts = REPO / "runs" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "viewer.png"
    subprocess.run(
        flags + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120
    )
    assert shot.exists() and shot.stat().st_size > 10_000


def test_train_from_store_replays_the_learning_without_rollouts(e2e_run, tiny_policy, tmp_path):
    """`--from-store`: the learner alone, fed the stored shards in order; with the same starting
    weights and seed it takes the same steps as the run that collected them."""
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    _, rows, source = e2e_run
    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        ["iterations=2", f"policy.path={tiny_policy}", "algo.entropy_coef=0.01"],
    )
    trainer = Trainer(cfg, tmp_path / "from-store", from_store=source)
    try:
        trainer.start()
        assert trainer.workers == [] and trainer.env_workers == []
        again = trainer.run()
    finally:
        trainer.close()
    assert [r["policy_version"] for r in again] == [1, 2]
    for a, b in zip(again, rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["mean_reward"] == b["mean_reward"] and "sync_s" not in a  # no workers, no sync
    copied = sorted(t.episode_id for t in TrajectoryStore(tmp_path / "from-store").trajectories())
    assert copied == sorted(t.episode_id for t in TrajectoryStore(source).trajectories())


def test_train_from_store_names_a_missing_store(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "train",
            "configs/quickstart.yaml",
            "--run-dir",
            str(tmp_path / "x"),
            "--from-store",
            str(tmp_path / "nothing"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--from-store" in r.stderr and "no trajectory shards" in r.stderr
