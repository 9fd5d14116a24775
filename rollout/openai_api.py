"""An OpenAI-compatible chat API over a rollout engine that records the exact tokens of every call.

`OpenAIServer(engine, tokenizer, model)` serves, on loopback by default:

- `POST /v1/chat/completions` and `GET /v1/models`, and the same under a session path,
  `/sessions/{session}/v1/...`, which an agent program gets as its `base_url` (one session per
  episode, so concurrent episodes never mix);
- requests are parsed and answered with vLLM's own OpenAI protocol models (`ChatCompletionRequest`,
  `ChatCompletionResponse`, `ErrorResponse`); messages (with `tools`, assistant `tool_calls` and
  `tool` results) are rendered with the checkpoint's chat template, the same one the agent loop
  uses (rollout/chat.py), and tool calls in a completion (`<tool_call>` blocks, envs/tool_calls.py)
  come back as OpenAI `tool_calls`;
- supported: temperature, top_p, max_tokens / max_completion_tokens, n, seed, stop (strings) and
  stop_token_ids, logprobs (the sampled token's own; `top_logprobs` > 0 is refused), `stream` (with
  `stream_options.include_usage`). Not (yet): images in messages, `logit_bias`, penalties,
  `response_format`: refused with an OpenAI-style 400 that names the field, never silently ignored.
- a streamed answer is sent once the completion is generated, as OpenAI chunks (a role chunk, the
  content, each tool call whole, the finish reason, `[DONE]`): clients and frameworks that stream
  work unchanged; the first token arrives with the last.

In a training run (`training=`), every call samples at the run's temperature and top_p whatever it
asks (the learner's log-probs assume them; calls that asked otherwise are counted in `overridden`)
and at most the run's max_new_tokens.

Every call is recorded (`CallRecord`: the prompt ids it was rendered to, the ids the engine
sampled, their log-probs, the policy version, the finish reason), per session, for `take(session)`:
training uses those ids, never a re-rendering of the conversation.

Prompts are spliced (rollout/splice.py): a call that continues a conversation this endpoint
answered is prompted with the ids the session actually had — the earlier call's prompt and sampled
ids — followed by the tokens of what was added, never a re-tokenisation of the whole rendering. A
history the agent rewrote is rendered whole, and its prompt visibly does not extend the sampled ids.

Engines: a `SharedEngine` (rollout/engines/shared.py: what rollout workers and `longhorizon serve`
run) batches continuously, and each request's prompts join its running batch; any other engine is
owned by one thread (`Batcher`), and calls that arrive together from concurrent sessions are
generated in one engine call.

Hostile or broken clients: a request body over `max_body_bytes` is refused (413) before it is read
whole; a body that is not JSON, JSON with NaN or Infinity, nesting deeper than Python parses, wrong
types or out-of-range values get a 400 with an OpenAI error body (never a 500, never a traceback in
the log); a `model` other than the one served is a 404; `n × max_tokens` may not exceed
`max_request_tokens`; a client that disconnects, or a request that runs past `request_timeout_s`
(504), has its generation cancelled (its prompts leave a shared engine's batch at the next step;
with a `Batcher` only a call not started yet is). No request takes the server down. Bound to an
address other than loopback, the server requires `api_key` (a bearer token, not blank) and refuses
to start without one.

Agent programs get these sessions from the rollout worker (envs/agent_program.py), and a session's
calls become the episode's trajectory in rollout/program_episodes.py.

Not covered: token-by-token streaming (see above); continuous batching for engines that cannot be
stepped (there a batch of calls is one engine call, and a call that arrives while one runs waits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from envs.tool_calls import OPEN, parse_tool_calls
from rollout.chat import ChatFormat
from rollout.engines.base import Generation
from rollout.splice import Splicer, message_key

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# fields of ChatCompletionRequest this server does not honour, with the value that means "unused"
UNSUPPORTED = {
    "logit_bias": None,
    "frequency_penalty": None,
    "presence_penalty": None,
    "response_format": None,
    "use_beam_search": False,
    "repetition_penalty": None,
    "top_k": None,
    "min_p": None,
    "prompt_logprobs": None,
    "echo": False,
}


@dataclass
class CallRecord:
    """One sampled completion, as the engine produced it."""

    session: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str
    """`stop` (end of turn or a stop string), `length` (max_tokens)."""
    seed: int
    created: float = field(default_factory=time.time)
    messages: list[dict] = field(default_factory=list)
    """The request's messages as the template read them (`render_messages`): what the agent sent,
    so an episode shows the tool results it received as text, not as template tokens."""
    tool_names: list[str] | None = None
    """The tools the request offered (None: it offered none), to tell a call to a tool the agent
    does not have (`unknown_tool`)."""


class RequestError(ValueError):
    """A request this server cannot answer as asked (an OpenAI `invalid_request_error`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Batcher:
    """Engine calls for concurrent requests: `submit` queues a prompt; prompts queued within `wait_s`
    of each other, with the same sampling settings, share one engine call.

    The engine is driven either by a thread of the batcher's own (`own_thread`), or by whoever calls
    `drive` — the thread that made the engine. vLLM's CPU backend keeps per-thread state (its OpenMP
    team, bound to the cores, and the thread count its attention metadata is built for): in a Ray
    actor started with OMP_NUM_THREADS=1, a second thread built attention metadata for one thread
    while the kernel ran two ("cpu_attn_impl.hpp: Check failed: thread_num == thread_num (1 vs. 2)"),
    so a rollout worker drives its engine from its own main thread."""

    def __init__(self, engine, max_batch: int = 64, wait_s: float = 0.01, own_thread: bool = True):
        self.engine, self.max_batch, self.wait_s = engine, max_batch, wait_s
        self.batch_sizes: list[int] = []
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = (
            threading.Thread(target=self._loop, name="openai-batcher", daemon=True)
            if own_thread
            else None
        )
        if self._thread is not None:
            self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop_token_ids: list[int],
        stop: list[str],
    ) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        key = (temperature, top_p, tuple(stop_token_ids), tuple(stop))
        self._q.put((key, prompt_ids, max_tokens, seed, fut))
        return fut

    def close(self) -> None:
        self._closed = True
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def needs_driver(self) -> bool:
        """No thread of its own: queued requests run only while someone calls `drive`."""
        return self._thread is None

    def drive(self, done) -> None:
        """Run the queued requests from the calling thread until `done()` (checked at least every 50 ms)."""
        while not done():
            self._serve(timeout=0.05)

    def _loop(self) -> None:
        while not self._closed:
            self._serve(timeout=None)

    def _serve(self, timeout: float | None) -> None:
        try:
            first = self._q.get(timeout=timeout)
        except queue.Empty:
            return
        if first is None:
            return
        items, deadline = [first], time.monotonic() + self.wait_s
        while len(items) < self.max_batch:
            try:
                item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                break
            items.append(item)
        groups: dict = {}
        for item in items:
            # a call cancelled while it waited never starts
            if item[4].set_running_or_notify_cancel():
                groups.setdefault(item[0], []).append(item)
        for (temperature, top_p, stop_ids, stop), group in groups.items():
            self.batch_sizes.append(len(group))
            try:
                version = self.engine.version
                gens = self.engine.generate(
                    [g[1] for g in group],
                    max_tokens=[g[2] for g in group],
                    temperature=temperature,
                    top_p=top_p,
                    stop_token_ids=list(stop_ids) or None,
                    seeds=[g[3] for g in group],
                    **({"stop": list(stop)} if stop else {}),
                )
                for g, gen in zip(group, gens):
                    g[4].set_result((gen, version if gen.version is None else gen.version))
            except Exception as exc:  # noqa: BLE001  (each waiting call answers with it)
                for g in group:
                    if not g[4].done():
                        g[4].set_exception(exc)


def _text(content, where: str) -> str:
    """A message's content as text (a string, or a list of text parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}: only text content is supported, not {kind!r}", "messages"
                )
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise RequestError(f"{where}: content must be a string or a list of text parts", "messages")


def render_messages(messages: list) -> list[dict]:
    """The request's messages as the chat template reads them (text content; tool calls kept)."""
    if not isinstance(messages, list):
        raise RequestError("messages must be a list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            try:
                m = dict(m)
            except (TypeError, ValueError):
                raise RequestError(
                    f"messages[{i}] must be a {{role, content}} object", "messages"
                ) from None
        m = dict(m)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}]: unknown role {role!r}", "messages")
        msg = {
            "role": "system" if role == "developer" else role,
            "content": _text(m.get("content"), f"messages[{i}]"),
        }
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [dict(tc) for tc in m["tool_calls"]]
        out.append(msg)
    if not out:
        raise RequestError("messages must not be empty", "messages")
    return out


def completion_message(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completion: the text before the first `<tool_call>`, and each
    well-formed call as an OpenAI tool call (a malformed block stays in the content, for the agent
    to see)."""
    calls, errors = parse_tool_calls(text)
    if not calls or errors:
        return text, []
    content = text[: text.find(OPEN)].strip()
    return content or None, [
        {
            "id": f"call_{secrets.token_hex(8)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


class OpenAIServer:
    """The API over `engine` (see the module doc); `start()` serves it from a background thread."""

    def __init__(
        self,
        engine,
        tokenizer,
        model: str,
        *,
        max_model_len: int,
        default_max_tokens: int = 512,
        api_key: str = "",
        training: dict | None = None,
        own_thread: bool = True,
        max_body_bytes: int = 4 << 20,
        max_request_tokens: int = 1 << 15,
        request_timeout_s: float = 600.0,
    ):
        if api_key and not api_key.strip():
            raise ValueError(
                "api_key is blank (only whitespace): give a real token, or none on loopback"
            )
        self.engine, self.model, self.max_model_len = engine, model, max_model_len
        # limits per request (see the module doc)
        self.max_body_bytes, self.max_request_tokens = max_body_bytes, max_request_tokens
        self.request_timeout_s = request_timeout_s
        # in a training run: {temperature, top_p, max_tokens} the learner assumes; a request's own values
        # are replaced (the learner's log-probs use the run's temperature), and counted
        self.training, self.overridden = training, 0
        self.chat = ChatFormat(tokenizer)
        self.default_max_tokens, self.api_key = default_max_tokens, api_key
        # own_thread=False: the caller drives the engine
        self.batcher = Batcher(engine, own_thread=own_thread)
        self.records: dict[str, list[CallRecord]] = {}
        self.splicer = Splicer(self.chat)
        self._lock = threading.Lock()
        self._server = self._thread = None
        self.port = 0

    @contextlib.contextmanager
    def sampling(self, temperature: float):
        """Within the block, a training run's calls sample at `temperature` (held-out evaluation's
        `eval.temperature`) instead of the run's."""
        saved = self.training
        self.training = {
            **(saved or {"top_p": 1.0, "max_tokens": self.default_max_tokens}),
            "temperature": temperature,
        }
        try:
            yield self
        finally:
            self.training = saved

    # --- sessions ---
    def take(self, session: str) -> list[CallRecord]:
        """The session's calls so far, in order; forgotten here."""
        self.splicer.forget(session)
        with self._lock:
            return self.records.pop(session, [])

    def _record(self, rec: CallRecord) -> None:
        with self._lock:
            self.records.setdefault(rec.session, []).append(rec)

    # --- one request ---
    def _sampling(self, req) -> dict:
        for name, unused in UNSUPPORTED.items():
            if getattr(req, name, unused) not in (unused, None):
                raise RequestError(f"{name} is not supported by this server", name)
        if req.logprobs and req.top_logprobs:
            raise RequestError(
                "top_logprobs is not supported (logprobs gives the sampled token's own)",
                "top_logprobs",
            )
        max_tokens = next(
            (x for x in (req.max_completion_tokens, req.max_tokens) if x is not None),
            self.default_max_tokens,
        )
        if max_tokens < 1:
            raise RequestError("max_tokens must be >= 1", "max_tokens")
        n = req.n or 1
        if not 1 <= n <= 64:
            raise RequestError("n must be from 1 to 64", "n")
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if not (math.isfinite(temperature) and temperature >= 0) or not (
            math.isfinite(top_p) and 0 < top_p <= 1
        ):
            raise RequestError(
                "temperature must be a finite number >= 0 and top_p in (0, 1]", "temperature"
            )
        if self.training is not None:
            t = self.training
            if (req.temperature not in (None, t["temperature"])) or (
                req.top_p not in (None, t["top_p"])
            ):
                self.overridden += 1
            temperature, top_p, max_tokens = (
                t["temperature"],
                t["top_p"],
                min(max_tokens, t["max_tokens"]),
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if (
            stop
            and self.engine is not None
            and "stop" not in inspect.signature(self.engine.generate).parameters
        ):
            raise RequestError(
                f"stop strings are not supported by this engine ({type(self.engine).__name__}); "
                "use stop_token_ids",
                "stop",
            )
        return dict(
            max_tokens=max_tokens,
            n=n,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []) + [self.chat.eot_id],
        )

    async def complete(self, session: str, body: dict, gone=None) -> dict:
        """The answer to one chat request. `gone`: an async callable telling whether the client has
        left (its generation is then cancelled, as past `request_timeout_s`)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        if body.get("model") not in (None, self.model):
            raise RequestError(
                f"model {str(body['model'])[:80]!r} is not served here; this server serves "
                f"{self.model!r}",
                "model",
                status=404,
            )
        from pydantic import ValidationError

        # vLLM's own validators iterate it before pydantic checks it
        if not isinstance(body.get("messages"), list):
            raise RequestError("messages must be a list of {role, content} objects", "messages")
        try:
            req = ChatCompletionRequest(**body)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise RequestError(
                f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                str(first["loc"][0]) if first["loc"] else None,
            ) from None
        except (
            TypeError,
            ValueError,
            AttributeError,
        ) as exc:  # a validator of vLLM's that met a wrong type
            raise RequestError(
                f"the request does not fit the chat completion schema: {' '.join(str(exc).split())[:200]}"
            ) from None
        s = self._sampling(req)
        messages = render_messages(req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            prompt, text = self.splicer.prompt(session, messages, tools)
        except Exception as exc:  # noqa: BLE001  (the template's own complaint, named)
            raise RequestError(
                f"the chat template cannot render these messages: {exc}", "messages"
            ) from None
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens; the model's context is {self.max_model_len}",
                "messages",
            )
        max_tokens = min(s["max_tokens"], room)
        if s["n"] * max_tokens > self.max_request_tokens:
            raise RequestError(
                f"n × max_tokens = {s['n']} × {max_tokens} = {s['n'] * max_tokens} tokens is more than "
                f"this server generates for one request ({self.max_request_tokens}); ask for fewer",
                "max_tokens",
            )
        seed0 = req.seed if req.seed is not None else secrets.randbelow(1 << 31)
        seeds = [(seed0 + i) & 0x7FFFFFFF for i in range(s["n"])]
        results = await self._generate(prompt, seeds, max_tokens, s, gone)
        choices, completion_tokens = [], 0
        for i, (gen, version) in enumerate(results):
            finish = "length" if gen.finish_reason == "length" else "stop"
            self._record(
                CallRecord(
                    session,
                    list(prompt),
                    list(gen.token_ids),
                    list(gen.logprobs),
                    version,
                    finish,
                    seeds[i],
                    messages=messages,
                    tool_names=[t["function"]["name"] for t in tools if "function" in t]
                    if tools
                    else None,
                )
            )
            choice = self._choice(i, gen, finish, s["stop"], bool(req.logprobs))
            self.splicer.add(
                session,
                text,
                prompt,
                gen.token_ids,
                message_key(
                    choice.message.content, [tc.model_dump() for tc in choice.message.tool_calls]
                ),
            )
            choices.append(choice)
            completion_tokens += len(gen.token_ids)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        usage = UsageInfo(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        )
        return ChatCompletionResponse(model=self.model, choices=choices, usage=usage).model_dump(
            exclude_none=True
        )

    async def _generate(
        self, prompt: list[int], seeds: list[int], max_tokens: int, s: dict, gone
    ) -> list:
        """[(Generation, policy version)] per seed. A shared engine gets the n prompts as one request
        that joins its running batch; any other engine, one Batcher call per prompt. Cancelled when
        `gone()` says the client left (a 499) or past `request_timeout_s` (a 504)."""
        from rollout.engines.shared import Cancelled

        sampling = dict(
            temperature=s["temperature"], top_p=s["top_p"], stop_token_ids=s["stop_token_ids"]
        )
        cancel = threading.Event()
        # a SharedEngine: its own thread
        if getattr(self.engine, "continuous_batching", None) is not None:

            def run():
                gens = self.engine.generate(
                    [prompt] * len(seeds),
                    max_tokens=max_tokens,
                    seeds=seeds,
                    cancel=cancel,
                    **sampling,
                    **({"stop": s["stop"]} if s["stop"] else {}),
                )
                return [
                    (g, g.version if g.version is not None else self.engine.version) for g in gens
                ]

            waiting, shared = [asyncio.ensure_future(asyncio.to_thread(run))], True
        else:
            futures = [
                self.batcher.submit(
                    prompt, max_tokens=max_tokens, seed=seed, stop=s["stop"], **sampling
                )
                for seed in seeds
            ]
            waiting, shared = [asyncio.wrap_future(f) for f in futures], False
        deadline = time.monotonic() + self.request_timeout_s
        why = None
        while not all(w.done() for w in waiting):
            await asyncio.wait(waiting, timeout=0.25, return_when=asyncio.ALL_COMPLETED)
            if all(w.done() for w in waiting):
                break
            if time.monotonic() > deadline:
                why = (
                    f"the request ran past this server's limit of {self.request_timeout_s:g} s and was cancelled",
                    504,
                )
            elif gone is not None and await gone():
                why = ("the client disconnected; its generation was cancelled", 499)
            if why:
                cancel.set()
                for w in waiting:
                    w.cancel()  # a Batcher call not started yet never starts (its future is cancelled)
                raise RequestError(why[0], None, status=why[1])
        try:
            out = [w.result() for w in waiting]
        except Cancelled as exc:
            raise RequestError(str(exc), None, status=499) from None
        return out[0] if shared else out

    def _choice(self, index: int, gen: Generation, finish: str, stop: list[str], logprobs: bool):
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
            ChatCompletionResponseChoice,
            ChatMessage,
        )

        text = self.chat.decode(gen.token_ids)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            text = text[: min(cuts)]
        content, tool_calls = completion_message(text)
        lp = None
        if logprobs:
            toks = self.chat.tok.convert_ids_to_tokens(gen.token_ids)
            lp = ChatCompletionLogProbs(
                content=[
                    ChatCompletionLogProbsContent(token=t, logprob=x, bytes=list(t.encode()))
                    for t, x in zip(toks, gen.logprobs)
                ]
            )
        message = ChatMessage(role="assistant", content=content, tool_calls=tool_calls)
        return ChatCompletionResponseChoice(
            index=index,
            message=message,
            logprobs=lp,
            finish_reason="tool_calls" if tool_calls and finish == "stop" else finish,
            token_ids=list(gen.token_ids),
        )

    # --- HTTP ---
    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI(title="longhorizon OpenAI-compatible API", docs_url=None, redoc_url=None)

        def error(
            message: str,
            status: int = 400,
            param: str | None = None,
            kind: str = "invalid_request_error",
        ):
            from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

            body = ErrorResponse(
                error=ErrorInfo(message=message, type=kind, param=param, code=status)
            )
            return JSONResponse(body.model_dump(), status_code=status)

        expected = f"Bearer {self.api_key}".encode() if self.api_key else None

        class Bearer:
            """The key check as plain ASGI: Starlette's `@app.middleware` wraps `receive`, and a handler
            behind it never sees its client disconnect (its generation would run on for nobody)."""

            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if (
                    expected
                    and scope["type"] == "http"
                    and dict(scope["headers"]).get(b"authorization") != expected
                ):
                    answer = error(
                        "a valid bearer token is required (Authorization: Bearer ...)",
                        401,
                        kind="authentication_error",
                    )
                    return await answer(scope, receive, send)
                await self.inner(scope, receive, send)

        app.add_middleware(Bearer)

        async def models():
            from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

            return ModelList(
                data=[
                    ModelCard(
                        id=self.model, owned_by="longhorizon", max_model_len=self.max_model_len
                    )
                ]
            ).model_dump(exclude_none=True)

        async def chat(request: Request, session: str = ""):
            raw = await self._body(request)
            if isinstance(raw, RequestError):
                return error(str(raw), raw.status, raw.param)
            try:
                body = json.loads(raw, parse_constant=_no_constant)
            except RecursionError:
                return error("the request body nests too deeply")
            except ValueError as exc:
                return error(f"the request body is not JSON: {' '.join(str(exc).split())[:200]}")
            if not isinstance(body, dict):
                return error("the request body must be a JSON object")
            try:
                answer = await self.complete(session, body, request.is_disconnected)
                if body.get("stream"):
                    from fastapi.responses import StreamingResponse

                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return StreamingResponse(
                        iter(stream_chunks(answer, usage)), media_type="text/event-stream"
                    )
                return answer
            except RequestError as exc:
                return error(str(exc), exc.status, exc.param)
            except (
                TypeError,
                ValueError,
                RecursionError,
            ) as exc:  # a request no check above foresaw: the client's
                return error(
                    f"the request cannot be answered: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                )
            except Exception as exc:  # noqa: BLE001  (the engine's failure: a 500 with its reason, the server lives)
                return error(
                    f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                    500,
                    kind="server_error",
                )

        app.get("/v1/models")(models)
        app.get("/sessions/{session}/v1/models")(models)
        app.post("/v1/chat/completions")(chat)
        app.post("/sessions/{session}/v1/chat/completions")(chat)
        return app

    async def _body(self, request) -> bytes | RequestError:
        """The request body, read no further than `max_body_bytes` (a 413 error beyond)."""
        limit = self.max_body_bytes
        too_big = RequestError(
            f"the request body is larger than this server takes ({limit:,} bytes)", None, status=413
        )
        try:
            if int(request.headers.get("content-length") or 0) > limit:
                return too_big
        except ValueError:
            return RequestError("the Content-Length header is not a number")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from a background thread; returns the base URL (`http://HOST:PORT`)."""
        import uvicorn

        if host not in LOOPBACK and not self.api_key:
            raise ValueError(
                f"serving on {host} (not loopback) needs an api_key: a bearer token every request must carry"
            )
        config = uvicorn.Config(
            self.app(), host=host, port=port, log_level="warning", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="openai-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI-compatible server did not start on {host}:{port}")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://{'[::1]' if host == '::1' else host}:{self.port}"

    def base_url(self, session: str) -> str:
        """What an agent program is given: the session's OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/sessions/{session}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        self.batcher.close()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def stream_chunks(answer: dict, include_usage: bool = False) -> list[str]:
    """A finished chat completion (`complete`'s answer) as the server-sent events of a stream: per
    choice a role chunk, its content, each tool call whole (with its index and id), a chunk with the
    finish reason (and the sampled ids); then the usage if asked; then `[DONE]`."""
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )

    head = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}

    def event(choices: list, usage=None) -> str:
        body = ChatCompletionStreamResponse(**head, choices=choices, usage=usage).model_dump(
            exclude_none=True
        )
        return f"data: {json.dumps(body)}\n\n"

    out = []
    for c in answer["choices"]:
        i, message = c["index"], c["message"]
        out.append(
            event(
                [
                    ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                ]
            )
        )
        if message.get("content"):
            out.append(
                event(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i,
                            delta=DeltaMessage(content=message["content"]),
                            logprobs=c.get("logprobs"),
                        )
                    ]
                )
            )
        for k, tc in enumerate(message.get("tool_calls") or []):
            call = DeltaToolCall(
                index=k,
                id=tc["id"],
                type="function",
                function=DeltaFunctionCall(
                    name=tc["function"]["name"], arguments=tc["function"]["arguments"]
                ),
            )
            out.append(
                event(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(tool_calls=[call])
                        )
                    ]
                )
            )
        out.append(
            event(
                [
                    ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=DeltaMessage(),
                        finish_reason=c["finish_reason"],
                        token_ids=c.get("token_ids"),
                    )
                ]
            )
        )
    if include_usage:
        out.append(event([], usage=answer["usage"]))
    return out + ["data: [DONE]\n\n"]
