"""The OpenAI-compatible API over a rollout engine (rollout/openai_api.py), through the real `openai`
client: exact token records, sessions that do not mix, batched engine calls, tool calls both ways,
OpenAI-style errors for malformed requests, and the bearer token off loopback."""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import openai
import pytest

from rollout.chat import ChatFormat
from rollout.openai_api import OpenAIServer, completion_message, render_messages

HISTORY = [
    {"role": "system", "content": "You solve arithmetic with tools."},
    {"role": "user", "content": "What is 2+2?"},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture
def bare_server(tokenizer):
    """A server whose engine is never reached: what is checked happens before generation."""
    server = OpenAIServer(None, tokenizer, "tiny", max_model_len=256)
    url = server.start()
    yield server, url
    server.stop()


def test_a_completion_becomes_openai_tool_calls():
    content, calls = completion_message(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    )
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "6*7"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # a malformed block stays text for the agent to read; plain text has no calls
    assert completion_message("<tool_call>\nnot json\n</tool_call>") == (
        "<tool_call>\nnot json\n</tool_call>",
        [],
    )
    assert completion_message("just words") == ("just words", [])


def test_tool_call_history_renders_with_the_checkpoint_template(tokenizer):
    text = tokenizer.decode(ChatFormat(tokenizer).prompt_ids(render_messages(HISTORY), TOOLS))
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        in text
    )
    assert (
        "<tool_response>\n4\n</tool_response>" in text
        and '"name": "calculator"' in text.split("\n</tools>")[0]
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert render_messages(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    ) == [{"role": "system", "content": "ab"}]


def test_a_tool_call_sent_back_is_spliced_not_re_rendered(tokenizer):
    """The template renders a bare tool call with a leading newline the model never wrote: tokenising
    the re-rendering would not extend the sampled ids, the splice does."""
    from rollout.splice import Splicer, message_key

    chat, splicer = ChatFormat(tokenizer), Splicer(ChatFormat(tokenizer))
    first = [{"role": "user", "content": "What is 2+2?"}]
    prompt, text = splicer.prompt("s", first, TOOLS)
    assert prompt == chat.prompt_ids(first, TOOLS)
    raw = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    for ended in (True, False):  # stopped at the end-of-turn token, or cut by max_tokens
        completion = chat.encode(raw) + ([chat.eot_id] if ended else [])
        content, calls = completion_message(chat.decode(completion))
        splicer.forget("s")
        splicer.add("s", text, prompt, completion, message_key(content, calls))
        # what the openai client sends back: content None, arguments re-serialised by the agent
        sent = first + [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": calls[0]["id"],
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression":"2+2"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "4"},
        ]
        ids, _ = splicer.prompt("s", sent, TOOLS)
        sampled = prompt + completion
        assert ids[: len(sampled)] == sampled
        added = tokenizer.decode(ids[len(sampled) :])
        assert (
            added
            == ("" if ended else "<|im_end|>")
            + "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        # what re-rendering would have trained on
        assert chat.prompt_ids(sent, TOOLS)[: len(sampled)] != sampled
    # an edited assistant message is a rewritten history: rendered whole
    edited = (
        sent[:1]
        + [{"role": "assistant", "content": "I will add.", "tool_calls": sent[1]["tool_calls"]}]
        + sent[2:]
    )
    assert splicer.prompt("s", edited, TOOLS)[0] == chat.prompt_ids(edited, TOOLS)
    # sessions do not share
    assert splicer.prompt("other", sent, TOOLS)[0] == chat.prompt_ids(sent, TOOLS)


def test_malformed_requests_get_openai_error_bodies(bare_server):
    server, url = bare_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    cases = [
        (dict(messages=[{"role": "bogus", "content": "x"}]), "unknown role 'bogus'"),
        (
            dict(messages=[{"role": "user", "content": "x"}], frequency_penalty=0.5),
            "frequency_penalty is not supported",
        ),
        (
            dict(messages=[{"role": "user", "content": "x"}], max_tokens=0),
            "max_tokens must be >= 1",
        ),
        (
            dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3),
            "top_logprobs",
        ),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            ),
            "only text content",
        ),
        (
            dict(messages=[{"role": "user", "content": "many words " * 200}]),
            "the model's context is 256",
        ),
        (dict(messages=[]), "messages must not be empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", **kwargs)
        assert err.value.status_code == 400 and message in err.value.message, (
            kwargs,
            err.value.message,
        )
    for body in (b"{not json", b"[1, 2]", json.dumps({"messages": "hello"}).encode()):
        r = httpx.post(
            f"{url}/sessions/s/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        error = r.json()["error"]
        assert (
            r.status_code == 400
            and error["type"] == "invalid_request_error"
            and error["code"] == 400
            and error["message"]
        )
    assert server.records == {}  # nothing was generated, nothing recorded


def test_a_streamed_answer_is_the_same_answer_in_chunks(tokenizer):
    """`stream=True` through the `openai` client: the chunks add up to the unstreamed answer (content,
    a tool call with its arguments, the finish reason, usage when asked) and the call is recorded
    like any other. The engine answers every call with a fixed tool call (rollout/recorded.py)."""
    from rollout.recorded import FixedEngine

    chat = ChatFormat(tokenizer)
    reply = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    server = OpenAIServer(
        FixedEngine(chat.encode(reply) + [chat.eot_id]), tokenizer, "tiny", max_model_len=2048
    )
    url = server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url("s"), api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=64)
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(
            client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert (
            chunks[0].choices[0].delta.role == "assistant"
            and content == whole.message.content == "Let me compute."
        )
        assert [
            (tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls
        ] == [(0, "calculator", {"expression": "6*7"})] and calls[0].id.startswith("call_")
        assert finish == ["tool_calls"] == [whole.finish_reason]
        assert (
            chunks[-1].usage.completion_tokens == len(chat.encode(reply)) + 1
            and not chunks[-1].choices
        )
        records = server.take("s")
        assert len(records) == 2 and records[0].completion_ids == records[
            1
        ].completion_ids == chat.encode(reply) + [chat.eot_id]
        raw = httpx.post(f"{url}/v1/chat/completions", json={**kwargs, "stream": True}).text
        # role, content, call, finish, done
        assert raw.rstrip().endswith("data: [DONE]") and raw.count("data: ") == 5
    finally:
        server.stop()


def test_a_bearer_token_off_loopback(tokenizer):
    with pytest.raises(ValueError, match="needs an api_key"):
        OpenAIServer(None, tokenizer, "tiny", max_model_len=256).start(host="0.0.0.0")
    server = OpenAIServer(None, tokenizer, "tiny", max_model_len=256, api_key="s3cret")
    url = server.start()
    try:
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert (
            openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list().data[0].id == "tiny"
        )
    finally:
        server.stop()


# --- with the real engine ---


@pytest.fixture(scope="module")
def served(engine, tokenizer):
    server = OpenAIServer(engine, tokenizer, "tiny", max_model_len=4096, default_max_tokens=16)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_the_openai_client_gets_completions_whose_exact_tokens_are_recorded(
    served, engine, tokenizer
):
    client = openai.OpenAI(base_url=served.base_url("ep-1"), api_key="unused")
    messages = HISTORY + [{"role": "user", "content": "And 3+3?"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=12,
        temperature=1.0,
        seed=123,
        logprobs=True,
        n=2,
    )
    records = served.take("ep-1")
    assert len(records) == 2 and len(r.choices) == 2 and served.take("ep-1") == []
    chat = ChatFormat(tokenizer)
    prompt = chat.prompt_ids(render_messages(messages), TOOLS)
    for rec, choice, seed in zip(records, r.choices, (123, 124)):
        # the prompt is the template's rendering; the completion is what the engine samples with that seed
        assert (
            rec.prompt_ids == prompt and rec.seed == seed and rec.policy_version == engine.version
        )
        again = engine.generate(
            [prompt],
            max_tokens=12,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[chat.eot_id],
            seeds=[seed],
        )[0]
        assert rec.completion_ids == again.token_ids and rec.logprobs == pytest.approx(
            again.logprobs, abs=1e-5
        )
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(rec.logprobs)
        assert choice.finish_reason == (
            "length"
            if len(rec.completion_ids) == 12 and rec.completion_ids[-1] != chat.eot_id
            else choice.finish_reason
        )
        if not choice.message.tool_calls:
            assert choice.message.content == chat.decode(rec.completion_ids)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == sum(
        len(x.completion_ids) for x in records
    )
    # a stop string ends the text; the ids recorded are still every id sampled
    free = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=16, seed=5
    )
    text = free.choices[0].message.content or ""
    if len(text) > 4:
        stop = text[2:4]
        cut = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=16,
            seed=5,
            stop=[stop],
        )
        assert cut.choices[0].message.content == text[: text.find(stop)]
        assert stop in chat.decode(served.take("ep-1")[-1].completion_ids)


@pytest.mark.slow
def test_a_run_s_sampling_wins_except_in_held_out_evaluation(engine, tokenizer):
    """In a training run every call samples at the run's temperature whatever it asks (counted);
    within `sampling(t)` (held-out evaluation) at `t`: temperature 0 gives the greedy completion."""
    chat = ChatFormat(tokenizer)
    server = OpenAIServer(
        engine,
        tokenizer,
        "tiny",
        max_model_len=4096,
        training={"temperature": 1.0, "top_p": 1.0, "max_tokens": 8},
    )
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url("t"), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Count to ten."}]
        prompt = chat.prompt_ids(messages, None)
        client.chat.completions.create(
            model="tiny", messages=messages, temperature=0.0, max_tokens=50, seed=9
        )
        run = engine.generate(
            [prompt],
            max_tokens=8,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[chat.eot_id],
            seeds=[9],
        )[0]
        assert server.take("t")[0].completion_ids == run.token_ids and server.overridden == 1
        greedy = engine.generate(
            [prompt],
            max_tokens=8,
            temperature=0.0,
            top_p=1.0,
            stop_token_ids=[chat.eot_id],
            seeds=[0],
        )[0]
        with server.sampling(0.0):
            for seed in (1, 2):
                client.chat.completions.create(model="tiny", messages=messages, seed=seed)
        assert [r.completion_ids for r in server.take("t")] == [greedy.token_ids] * 2
        assert server.training["temperature"] == 1.0  # restored after the block
        assert greedy.token_ids != run.token_ids  # the two settings are told apart
    finally:
        server.stop()


@pytest.mark.slow
def test_concurrent_sessions_do_not_mix_and_share_engine_calls(served):
    n, barrier, errors = 6, threading.Barrier(6), []
    served.batcher.batch_sizes.clear()

    def agent(i: int):
        try:
            client = openai.OpenAI(base_url=served.base_url(f"s{i}"), api_key="unused")
            barrier.wait()
            for turn in range(2):
                client.chat.completions.create(
                    model="tiny",
                    max_tokens=8,
                    messages=[{"role": "user", "content": f"task number {i} turn {turn}"}],
                )
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    tok = served.chat.tok
    for i in range(n):
        records = served.take(f"s{i}")
        assert [
            f"task number {i} turn {k}" in tok.decode(r.prompt_ids) for k, r in enumerate(records)
        ] == [True, True]
    # sessions that asked together were generated together
    assert max(served.batcher.batch_sizes) > 1


@pytest.mark.slow
def test_a_session_that_sends_back_its_answers_stays_one_token_sequence(served, tokenizer):
    """Prefix splicing: the second call's prompt is the first call's exact ids plus what was added;
    a history rewritten by the agent cannot be spliced and is rendered whole."""
    client = openai.OpenAI(base_url=served.base_url("splice"), api_key="unused")
    messages = [{"role": "user", "content": "Start."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=1)
    reply = first.choices[0].message
    sent_back = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        sent_back["tool_calls"] = [tc.model_dump() for tc in reply.tool_calls]
    messages += [sent_back, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=2)
    rewritten = messages[:1] + [
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "Go on."},
    ]
    client.chat.completions.create(model="tiny", messages=rewritten, max_tokens=8, seed=3)
    a, b, c = served.take("splice")
    sampled = a.prompt_ids + a.completion_ids
    assert b.prompt_ids[: len(sampled)] == sampled and len(b.prompt_ids) > len(sampled)
    assert tokenizer.decode(b.prompt_ids[len(sampled) :]).endswith(
        "Go on.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert c.prompt_ids == ChatFormat(tokenizer).prompt_ids(render_messages(rewritten), None)
    assert c.prompt_ids[: len(sampled)] != sampled


@contextlib.contextmanager
def serving(tiny_policy: str, ignore_sigint: bool = False):
    """`longhorizon serve` on the tiny policy in a subprocess: (the process, its base URL) once it
    says where it serves. Its stderr is drained from then on (a pipe left full blocks the server's
    next write, its shutdown included); on the way out it gets SIGINT, must exit 0 within 60 s, and
    is killed if it does not, so no server is left behind for the tests after this one.
    `ignore_sigint`: started with SIGINT ignored, as a background job of a non-interactive shell is
    (and as pytest's own process may have it by then), which the server must not take as "never stop"."""
    import re
    import signal
    import subprocess
    import sys
    import threading

    from conftest import REPO

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "serve",
            tiny_policy,
            "--port",
            "0",
            "--model",
            "tiny",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if ignore_sigint
        else None,
        text=True,
        cwd=REPO,
    )
    try:
        for line in proc.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)
            if found:
                break
        else:
            raise AssertionError(f"serve exited with {proc.wait()} before serving")
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield proc, found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
def test_longhorizon_serve_answers_the_openai_client(tiny_policy):
    import subprocess
    import sys

    from conftest import REPO

    bad = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "serve", tiny_policy, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("error: --host 0.0.0.0 is not loopback")
        and not bad.stdout
    )
    with serving(tiny_policy, ignore_sigint=True) as (proc, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert client.models.list().data[0].id == "tiny"
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
        )
        assert 1 <= r.usage.completion_tokens <= 5
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    assert proc.stdout.read() == ""  # the command's stdout carries nothing but results


def test_hostile_requests_are_4xx_with_error_bodies_and_the_server_lives(tokenizer, capfd):
    """Before any generation: a body over the size limit (413, without reading it whole), NaN and
    Infinity, JSON nested 200,000 deep, wrong types, a model not served (404), n × max_tokens over
    the budget; each an OpenAI error body, nothing in the log, and the next request is answered."""
    import time

    server = OpenAIServer(
        None, tokenizer, "tiny", max_model_len=256, max_body_bytes=1 << 20, max_request_tokens=1000
    )
    url = server.start()
    post = lambda body, **kw: httpx.post(
        f"{url}/v1/chat/completions",
        content=body,  # noqa: E731
        headers={"content-type": "application/json"},
        timeout=30,
        **kw,
    )
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    try:
        t0 = time.monotonic()
        big = post(
            json.dumps({**ok, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
        )
        assert (
            big.status_code == 413
            and "larger than this server takes" in big.json()["error"]["message"]
        )
        assert time.monotonic() - t0 < 5
        cases = [
            (
                b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                400,
                "NaN",
            ),
            (
                b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
                400,
                "Infinity",
            ),
            (
                json.dumps({**ok, "temperature": 1e400}).replace("Infinity", "1e400").encode(),
                400,
                "finite",
            ),
            (b"[" * 200_000 + b"]" * 200_000, 400, "nests too deeply"),
            (json.dumps({**ok, "messages": 5}).encode(), 400, "messages"),
            (json.dumps({**ok, "n": "many"}).encode(), 400, "n"),
            (json.dumps({**ok, "model": "gpt-5"}).encode(), 404, "'gpt-5' is not served here"),
            (
                json.dumps({**ok, "n": 64, "max_tokens": 1_000_000_000}).encode(),
                400,
                "n × max_tokens",
            ),
        ]
        for body, status, words in cases:
            r = post(body)
            err = r.json()["error"]
            assert r.status_code == status and words in err["message"] and err["code"] == status, (
                body[:80],
                r.text[:300],
            )
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"  # still answering
    finally:
        server.stop()
    logged = capfd.readouterr()
    assert "Traceback" not in logged.err + logged.out
    with pytest.raises(ValueError, match="api_key is blank"):
        OpenAIServer(None, tokenizer, "tiny", max_model_len=256, api_key="   ")


@pytest.mark.slow
def test_a_client_that_leaves_or_overstays_has_its_generation_cancelled(shared, tokenizer):
    """Over the real engine (continuous batching): a client that disconnects mid-generation has its
    prompts aborted (the engine goes idle at once, where the request asked for 4,000 tokens), a
    request past the deadline gets a 504, and a small request beside a long one is answered as
    soon as its own tokens are."""
    import time

    server = OpenAIServer(
        shared,
        tokenizer,
        "tiny",
        max_model_len=4096,
        max_request_tokens=1 << 16,
        request_timeout_s=2.0,
    )
    url = server.start()
    # 8 prompts of up to 4,000 tokens: a random model ends one with its end-of-turn token about every
    # 1,000 tokens, so some are still running when the client leaves
    long_body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write."}],
        "max_tokens": 4000,
        "n": 8,
        "temperature": 1.0,
    }
    try:
        # the client gives up after 1 s and closes the connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=long_body, timeout=1.0)
        time.sleep(1.0)
        assert shared.aborted >= 1  # the prompts still running were taken out of the batch
        before = shared.busy_s
        time.sleep(1.0)
        assert shared.busy_s - before < 0.2  # nothing generates any more
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=long_body, timeout=30)
        assert (
            r.status_code == 504
            and "ran past this server's limit of 2 s" in r.json()["error"]["message"]
        )
        assert time.monotonic() - t0 < 5
        server.request_timeout_s = 120.0
        done = {}
        slow = threading.Thread(
            target=lambda: done.setdefault(
                "long",
                httpx.post(
                    f"{url}/v1/chat/completions",
                    json={**long_body, "max_tokens": 1500},
                    timeout=120,
                ),
            )
        )
        slow.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        small = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
            },
            timeout=60,
        )
        took = time.monotonic() - t0
        slow.join()
        assert small.status_code == 200 and done["long"].status_code == 200
        # it joined the batch, it did not wait
        assert took < 0.5 * done["long"].elapsed.total_seconds()
    finally:
        server.stop()


@pytest.mark.slow
def test_longhorizon_serve_under_abuse_keeps_answering_and_gives_its_memory_back(tiny_policy):
    """`longhorizon serve` in a subprocess: a blank key is refused with one line; five 5 MB bodies
    are refused (413) without the server keeping their memory; sixteen small requests sent beside a
    long one are all answered, each within a bound, while it runs."""
    import concurrent.futures
    import re
    import subprocess
    import sys
    import time

    from conftest import REPO

    blank = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "serve", tiny_policy, "--api-key", "   "],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert blank.returncode == 2 and blank.stderr.strip() == (
        "error: the API key is blank (only whitespace): give a real token, or none on loopback"
    )
    with serving(tiny_policy) as (proc, base):

        def rss_mib() -> float:
            status = open(f"/proc/{proc.pid}/status").read()
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024

        url = f"{base}/v1/chat/completions"
        small = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(url, json=small, timeout=60).status_code == 200
        before = rss_mib()
        for _ in range(5):
            t0 = time.monotonic()
            r = httpx.post(
                url,
                content=b'{"model": "tiny", "messages": [{"role": "user", "content": "'
                + b"x" * (5 << 20)
                + b'"}]}',
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 413 and time.monotonic() - t0 < 5
        assert rss_mib() < before + 100  # the refused bodies were not kept
        with concurrent.futures.ThreadPoolExecutor(17) as pool:
            long = pool.submit(
                httpx.post, url, json={**small, "n": 8, "max_tokens": 2000}, timeout=300
            )
            time.sleep(1.0)
            quick = [pool.submit(httpx.post, url, json=small, timeout=300) for _ in range(16)]
            answers = [f.result() for f in quick]
            assert all(a.status_code == 200 for a in answers) and long.result().status_code == 200
        assert max(a.elapsed.total_seconds() for a in answers) < 30
