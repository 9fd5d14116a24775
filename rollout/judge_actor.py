"""Scoring ended episodes with the run's rubric, and the judge that scores its judge parts.

`JudgeScorer` holds a judge model in a vLLM engine (any local Hugging Face checkpoint; the run's
`reward.judge.model`, the packaged SmolLM2 by default) and answers `JudgeRequest`s
(rewards/judge.py) from log-probs of fixed continuations, through its `JudgeCache`. The engine
starts at the first request the cache cannot answer, so rescoring a stored run from its cache
starts none. `JudgeActor` is its Ray shell: one per run, restarted by Ray if it dies.

The flow in a run: a rollout worker's ended episodes get their judge requests sent to the actor
without waiting (`ask`: each trajectory keeps a handle on its pending scores); the trainer, when it
collects the episodes, waits for them (`settle`, at most `reward.judge.timeout_s`) and applies the
rubric. A judge that fails, dies or times out makes the episode an infrastructure error, kept out
of the group statistics, never a reward of 0.

Not covered here: several judge actors behind a router; judges on another node's GPU are only a
matter of the actor's resources.
"""

from __future__ import annotations

import os
import time

import ray

import envs
from rewards.judge import (
    LETTERS,
    JudgeCache,
    JudgeRequest,
    likelihood_score,
    rank_scores,
    verdict_score,
)
from rollout.trajectory import Trajectory


def _fail(t: Trajectory, why: str) -> None:
    t.infra_error = f"reward: {why}"
    t.failure = "infra_error"


def apply_rubric(rubric, t: Trajectory, judged: dict | None = None) -> Trajectory:
    """The run's rubric over an ended episode (rewards/rubric.py): its reward and each part's value
    (`judged`: the judge parts' scores). A part that fails makes the episode an infrastructure error
    (kept out of the group statistics), never reward 0. The default rubric (the environment's
    milestones) leaves the record as it is."""
    if rubric.is_default or t.infra_error:
        return t
    try:
        t.reward, t.reward_parts = rubric.score(t, judged)
    except Exception as exc:  # noqa: BLE001  (user code: any error is the part's, named)
        _fail(t, f"{type(exc).__name__}: {exc}")
    return t


class JudgeScorer:
    """A judge model answering judge requests, with a score cache (see the module doc)."""

    def __init__(
        self,
        model_path: str,
        cache_path: str | None = None,
        *,
        name: str = "",
        seed: int = 0,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
    ):
        from transformers import AutoTokenizer

        self.model_path, self.name = str(model_path), name or str(model_path)
        self.seed, self.max_model_len, self.kv_cache_gib = seed, max_model_len, kv_cache_gib
        self.cache = JudgeCache(cache_path)
        self.engine = None
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        yes, no = (self.tok.encode(w, add_special_tokens=False) for w in ("Yes", "No"))
        if len(yes) != 1 or len(no) != 1:
            raise ValueError(
                f"judge {self.name}: 'Yes' and 'No' must be one token each in its tokenizer "
                f"(got {yes}, {no})"
            )
        self.yes, self.no = yes[0], no[0]
        self.stats = {"requests": 0, "cache_hits": 0, "engine_s": 0.0}

    def pid(self) -> int:
        return os.getpid()

    def _engine(self):
        if self.engine is None:
            from rollout.engines.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(
                self.model_path,
                seed=self.seed,
                max_model_len=self.max_model_len,
                kv_cache_gib=self.kv_cache_gib,
            )
        return self.engine

    def _chat_ids(self, messages) -> list[int]:
        text = self.tok.apply_chat_template(
            [{"role": role, "content": c} for role, c in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.tok.encode(text, add_special_tokens=False)

    def _letters(self, n: int) -> list[int]:
        ids = [self.tok.encode(c, add_special_tokens=False) for c in LETTERS[:n]]
        if any(len(i) != 1 for i in ids):
            raise ValueError(
                f"judge {self.name}: the letters A-{LETTERS[n - 1]} must be one token each"
            )
        return [i[0] for i in ids]

    def _sequences(self, r: JudgeRequest) -> tuple[list[list[int]], object]:
        """The sequences to score for one request, and how to read its score from their log-probs."""
        if r.mode == "verdict":
            ids = self._chat_ids(r.messages)
            return [ids + [self.yes], ids + [self.no]], lambda lp: verdict_score(
                lp[0][-1], lp[1][-1]
            )
        if r.mode == "likelihood":
            target = self.tok.encode(r.target, add_special_tokens=False)
            return [self.tok.encode(r.prompt) + target], lambda lp: likelihood_score(
                lp[0][-len(target) :]
            )
        letters = self._letters(r.size)
        seqs = [ids + [c] for ids in map(self._chat_ids, r.chats) for c in letters]
        return seqs, lambda lp: rank_scores(
            [[lp[i * r.size + k][-1] for k in range(r.size)] for i in range(len(r.chats))]
        )

    def score(self, requests: list[JudgeRequest]) -> list[float]:
        """The requests' scores in [0, 1], flat (`JudgeRequest.size` each), from the cache or the
        engine (all misses in one call)."""
        keys = [r.key(self.name) for r in requests]
        found = [self.cache.get(k) for k in keys]
        todo = [i for i, v in enumerate(found) if v is None]
        self.stats["requests"] += len(requests)
        self.stats["cache_hits"] += len(requests) - len(todo)
        if todo:
            seqs, readers = [], []
            for i in todo:
                more, read = self._sequences(requests[i])
                readers.append((i, len(seqs), len(more), read))
                seqs += more
            too_long = max(len(s) for s in seqs)
            if too_long >= self.max_model_len:
                raise ValueError(
                    f"a judge prompt of {too_long} tokens does not fit the judge's max_model_len "
                    f"{self.max_model_len} (lower the judge part's max_chars)"
                )
            t0 = time.perf_counter()
            logps = self._engine().score_batch(seqs)
            self.stats["engine_s"] += time.perf_counter() - t0
            for i, start, n, read in readers:
                found[i] = read(logps[start : start + n])
            self.cache.put([(keys[i], found[i]) for i in todo], self.name)
        return [x for v in found for x in (v if isinstance(v, list) else [v])]


JudgeActor = ray.remote(JudgeScorer)


def judge_requests(rubric, t: Trajectory, env_kwargs: dict | None) -> list[JudgeRequest]:
    """What the judge is asked about one episode, one request per judge part that scores episodes
    alone (not `rank`)."""
    parts = [p for p in rubric.judges if p.fn.mode != "rank"]
    reference = envs.judge_reference(t.env_id, t.seed, env_kwargs) if parts else ""
    return [p.fn.request(t, reference) for p in parts]


def ran(t: Trajectory) -> bool:
    """The episode ran to its end: no infrastructure error, or one in its scoring (`reward: ...`),
    not in its environment (which leaves no answer to judge)."""
    return not t.infra_error or t.infra_error.startswith("reward: ")


def ranked_groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """The groups a `rank` judge compares, each in episode-id order, of the episodes that `ran`."""
    groups: dict = {}
    for t in sorted(trajectories, key=lambda t: t.episode_id):
        if ran(t):
            groups.setdefault((t.iteration, t.group_id), []).append(t)
    return list(groups.values())


def _send(judge, requests: list[JudgeRequest]):
    remote = getattr(getattr(judge, "score", None), "remote", None)
    try:
        return remote(requests) if remote else judge.score(requests)
    except Exception as exc:  # noqa: BLE001  (in-process judge: its failure is each episode's)
        return exc


def ask(
    rubric, trajectories: list[Trajectory], judge, env_kwargs: dict | None = None
) -> list[Trajectory]:
    """Score the ended episodes: with judge parts that score episodes alone, send their requests to
    `judge` (an actor: without waiting; each episode keeps in `judging` its pending scores, for
    `settle`); without judge parts, apply the rubric now. `judge` may also be an in-process
    `JudgeScorer` (answered at once). `rank` parts are asked for by `ask_groups`."""
    if not rubric.judges:
        return [apply_rubric(rubric, t) for t in trajectories]
    if judge is None:
        raise RuntimeError("the run's rubric has judge parts, and this worker was given no judge")
    requests, waiting = [], []
    names = [p.name for p in rubric.judges if p.fn.mode != "rank"]
    for t in trajectories:
        t.judging = []
        if t.infra_error:
            continue
        try:
            rs = judge_requests(rubric, t, env_kwargs)
        except Exception as exc:  # noqa: BLE001  (an environment's reference, a judge part's prompt)
            _fail(t, f"judge request: {type(exc).__name__}: {exc}")
            continue
        waiting.append((t, {name: len(requests) + i for i, name in enumerate(names)}))
        requests += rs
    if requests:
        pending = _send(judge, requests)
        for t, index in waiting:
            t.judging.append((pending, index))
    return trajectories


def ask_groups(rubric, trajectories: list[Trajectory], judge) -> None:
    """Send the `rank` parts' requests, one per group and part, for episodes that `ask` has seen:
    every group must be whole (the trainer calls it on an iteration's episodes, which partial
    rollouts would split, so a config with both is refused)."""
    parts = [p for p in rubric.judges if p.fn.mode == "rank"]
    if not parts:
        return
    requests, waiting = [], []
    for group in ranked_groups(trajectories):
        for p in parts:
            try:
                request = p.fn.group_request(group)
            except Exception as exc:  # noqa: BLE001
                for t in group:
                    _fail(t, f"judge request: {type(exc).__name__}: {exc}")
                continue
            offset = sum(r.size for r in requests)
            requests.append(request)
            waiting += [(t, p.name, offset + i) for i, t in enumerate(group)]
    if requests:
        pending = _send(judge, requests)
        for t, name, i in waiting:
            t.judging.append((pending, {name: i}))


def _key(pending) -> object:
    # one ref per worker call; the refs its episodes carry may arrive as distinct objects
    return pending.hex() if isinstance(pending, ray.ObjectRef) else id(pending)


def settle(rubric, trajectories: list[Trajectory], timeout_s: float) -> dict:
    """Wait (at most `timeout_s` in all) for the judge's scores of the episodes `ask` and
    `ask_groups` sent, and apply the rubric; a judge that failed, died or ran out of time makes its
    episodes infrastructure errors. Returns `judge/*` metrics."""
    pending = {_key(p): p for t in trajectories for p, _ in (t.judging or ())}
    if not pending:
        for t in trajectories:
            t.judging = None
        return {}
    t0, answers = time.perf_counter(), {}
    refs = [p for p in pending.values() if isinstance(p, ray.ObjectRef)]
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for key, p in pending.items():
        if isinstance(p, ray.ObjectRef):
            if p in late:
                answers[key] = TimeoutError(
                    f"the judge did not answer within reward.judge.timeout_s={timeout_s:g}s"
                )
                continue
            try:
                answers[key] = ray.get(p)
            except Exception as exc:  # noqa: BLE001  (a dead actor, an error in the judge)
                answers[key] = exc
        else:
            answers[key] = p
    failed = 0
    for t in trajectories:
        asked, t.judging = t.judging or [], None
        if not asked or t.infra_error:
            continue
        judged, error = {}, None
        for p, index in asked:
            scores = answers[_key(p)]
            if isinstance(scores, BaseException):
                error = getattr(scores, "cause", None) or scores
                break
            judged.update({name: scores[i] for name, i in index.items()})
        if error is not None:
            failed += 1
            _fail(t, f"judge failed: {type(error).__name__}: {' '.join(str(error).split())[:300]}")
            continue
        apply_rubric(rubric, t, judged)
    return {"judge/wait_s": time.perf_counter() - t0, "judge/failed_episodes": failed}
