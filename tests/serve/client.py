#!/usr/bin/env python3
"""Clients of `maxrun serve` for tests/tests/serve.rs: the official `openai`
package, the OpenAI Agents SDK (`agents`, its tracing off), raw HTTP
(http.client and sockets) and prometheus_client's parser of the text format. Each scenario exits 0 or raises with what went wrong.

    client.py SCENARIO URL EXPECTED.json

EXPECTED.json holds what the scenario needs: the texts `maxrun --prompt` and
`maxrun --chat` printed for the same requests, an API key, golden embeddings.
"""

import http.client
import concurrent.futures
import json
import socket
import sys
import threading
import time
import urllib.parse

import openai
from prometheus_client.parser import text_string_to_metric_families


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def host_port(url):
    u = urllib.parse.urlparse(url)
    return u.hostname, u.port


def raw(url, method, path, body=None, headers=None, timeout=60):
    """One HTTP request; returns (status, headers dict, body bytes)."""
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    conn.close()
    return out


def metrics(url):
    status, _, body = raw(url, "GET", "/metrics")
    check(status == 200, f"/metrics: {status}")
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            values[key] = s.value
    return values


def client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=120)


def scenario_golden(url, exp):
    """Completions and chat, whole and streamed, equal maxrun --prompt / --chat,
    with the right usage counts."""
    c = client(url, exp.get("api_key"))
    models = c.models.list()
    check([m.id for m in models.data] == [exp["model"]], f"models: {models}")
    for case in exp["completions"]:
        r = c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0)
        check(r.choices[0].text == case["text"], f"completion of {case['prompt']!r}: {r.choices[0].text!r} != {case['text']!r}")
        check(r.usage.prompt_tokens == case["prompt_tokens"], f"prompt tokens {r.usage}")
        check(r.usage.completion_tokens == case["completion_tokens"], f"completion tokens {r.usage} vs {case['completion_tokens']}")
        check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "total tokens")
        check(r.choices[0].finish_reason == case["finish_reason"], f"finish reason {r.choices[0].finish_reason}")
        # The same streamed, with usage in a last chunk.
        text, usage, finish, chunks = "", None, None, 0
        for chunk in c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, stream=True, stream_options={"include_usage": True}):
            chunks += 1
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        check(text == case["text"], f"streamed completion: {text!r} != {case['text']!r}")
        check(chunks > 2, f"{chunks} chunks: not streamed")
        check(usage is not None and usage.completion_tokens == case["completion_tokens"], f"streamed usage {usage}")
        check(finish == case["finish_reason"], f"streamed finish {finish}")
        # Token ids as the prompt give the same.
        r = c.completions.create(model=exp["model"], prompt=case["prompt_ids"], max_tokens=case["max_tokens"], temperature=0)
        check(r.choices[0].text == case["text"], "a prompt of token ids")
    for case in exp["chats"]:
        r = c.chat.completions.create(model=exp["model"], messages=case["messages"], max_tokens=case["max_tokens"], temperature=0)
        check(r.choices[0].message.role == "assistant", "role")
        check(r.choices[0].message.content == case["text"], f"chat: {r.choices[0].message.content!r} != {case['text']!r}")
        check(r.usage.prompt_tokens == case["prompt_tokens"], f"chat prompt tokens {r.usage} vs {case['prompt_tokens']}")
        check(r.choices[0].finish_reason == case["finish_reason"], f"chat finish {r.choices[0].finish_reason}")
        text, roles = "", []
        for chunk in c.chat.completions.create(model=exp["model"], messages=case["messages"], max_tokens=case["max_tokens"], temperature=0, stream=True):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                if ch.delta.role:
                    roles.append(ch.delta.role)
        check(text == case["text"], f"streamed chat: {text!r}")
        check(roles == ["assistant"], f"roles {roles}")
    # Log-probabilities: the chosen token's and alternatives, as OpenAI shapes them.
    r = c.completions.create(model=exp["model"], prompt=exp["completions"][0]["prompt"], max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    check(len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs), f"logprobs {lp}")
    check(all(len(t) == 2 for t in lp.top_logprobs), "two alternatives each")
    # Greedy picks the most likely token: its log-probability is the top one's.
    check(all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs)), "greedy takes the top token")


def scenario_concurrent(url, exp):
    """16 streaming clients at once; each gets its complete, correct text."""
    c = client(url, exp.get("api_key"))
    results, errors = {}, []

    def run(i, case):
        try:
            text = ""
            for chunk in c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, stream=True):
                for ch in chunk.choices:
                    text += ch.text
            results[i] = text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i, case)) for i, case in enumerate(exp["concurrent"])]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    check(not errors, f"errors: {errors}")
    for i, case in enumerate(exp["concurrent"]):
        check(results.get(i) == case["text"], f"client {i} ({case['prompt']!r}): {results.get(i)!r} != {case['text']!r}")
    m = metrics(url)
    check(m["maxrun_kv_blocks_used"] == 0, "blocks given back")
    print(f"16 concurrent streams in {time.time() - start:.1f} s")


def scenario_disconnect(url, exp):
    """A client that goes away mid-stream frees its blocks."""
    host, port = host_port(url)
    m0 = metrics(url)
    before, generated_before = m0.get("maxrun_cancelled_requests_total", 0), m0["maxrun_generated_tokens_total"]
    s = socket.create_connection((host, port), timeout=60)
    body = json.dumps({"prompt": "Tell me a long story about a dragon.", "max_tokens": 1500, "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    key = exp.get("api_key")
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data:") < 5:
        got += s.recv(4096)
    m = metrics(url)
    check(m["maxrun_kv_blocks_used"] > 0 and m["maxrun_running_sequences"] == 1, f"the request runs: {m}")
    s.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(url)
        if m["maxrun_kv_blocks_used"] == 0 and m["maxrun_running_sequences"] == 0:
            break
        time.sleep(0.05)
    check(m["maxrun_kv_blocks_used"] == 0, f"blocks still held after the client left: {m}")
    check(m.get("maxrun_cancelled_requests_total", 0) == before + 1, "counted as cancelled")
    time.sleep(0.5)
    after = metrics(url)["maxrun_generated_tokens_total"]
    check(after - generated_before < 1500 and after == m["maxrun_generated_tokens_total"], "stopped generating")


def scenario_bad_requests(url, exp):
    """Each bad request gets its documented status and OpenAI's error shape."""
    key = exp.get("api_key")
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    long_prompt = list(range(10, 10 + exp["max_length"] + 1))
    cases = [
        ("POST", "/v1/completions", b"{not json", 400, None, None),
        ("POST", "/v1/completions", b"", 400, None, None),
        ("POST", "/v1/completions", b"[1, 2]", 400, None, None),
        ("POST", "/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
        ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
        ("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 100}, 400, "n", None),
        ("POST", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]", None),
        ("POST", "/v1/completions", {"prompt": []}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ("POST", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ("POST", "/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs", None),
        ("POST", "/v1/completions", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", None),
        ("POST", "/v1/completions", {"prompt": [exp["vocab"] + 5]}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": long_prompt}, 400, "prompt", "context_length_exceeded"),
        ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": []}, 400, "functions", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}, 400, "logit_bias", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400, "stream_options", None),
        ("POST", "/v1/embeddings", {"input": "hi"}, 400, "model", None),
        ("GET", "/v1/nothing", None, 404, None, None),
    ]
    for method, path, body, status, param, code in cases:
        got, headers, data = raw(url, method, path, body, auth)
        what = f"{method} {path} {body!r}"
        check(got == status, f"{what}: status {got}, want {status}: {data[:300]!r}")
        err = json.loads(data)["error"]
        check(set(err) == {"message", "type", "param", "code"} and err["message"], f"{what}: error shape {err}")
        check(err["param"] == param, f"{what}: param {err['param']!r}, want {param!r}")
        if code:
            check(err["code"] == code, f"{what}: code {err['code']}")
        if code == "context_length_exceeded":
            check(str(len(long_prompt)) in err["message"] and str(exp["max_length"]) in err["message"], f"both numbers: {err['message']}")
    if key:
        got, _, data = raw(url, "POST", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"})
        check(got == 401 and json.loads(data)["error"]["type"] == "authentication_error", f"wrong key: {got}")
        got, _, _ = raw(url, "GET", "/v1/models")
        check(got == 401, f"no key: {got}")
        try:
            client(url, "wrong").completions.create(model=exp["model"], prompt="x", max_tokens=1)
            check(False, "the openai client got through with a wrong key")
        except openai.AuthenticationError:
            pass
    # vLLM's add_special_tokens is accepted (SmolLM2's tokenizer adds nothing either way).
    got, _, data = raw(url, "POST", "/v1/completions", {"prompt": "x", "add_special_tokens": False, "max_tokens": 1}, auth)
    check(got == 200 and json.loads(data)["usage"]["prompt_tokens"] == 1, f"add_special_tokens false: {got} {data[:200]!r}")
    check(raw(url, "GET", "/health")[0] == 200, "health")
    m = metrics(url)
    check(m.get("maxrun_requests_total{endpoint=/v1/completions,status=400}", 0) >= 14, f"400s counted: {m}")


def scenario_choices(url, exp):
    """n choices per prompt and lists of prompts (choice p * n + j is prompt p's
    j-th), whole and streamed; echo repeats the prompt, and with max_tokens 0
    and logprobs scores it: the log-probabilities of a greedy continuation
    scored as prompt equal those it was generated with."""
    c = client(url, exp.get("api_key"))
    case = exp["completions"][0]
    # Greedy choices are all the command line's text; the prompt counts once.
    r = c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, n=3)
    check([ch.index for ch in r.choices] == [0, 1, 2], f"indices {[ch.index for ch in r.choices]}")
    check(all(ch.text == case["text"] for ch in r.choices), f"greedy choices {[ch.text for ch in r.choices]}")
    check(r.usage.prompt_tokens == case["prompt_tokens"] and r.usage.completion_tokens == 3 * case["completion_tokens"], f"usage {r.usage}")
    # Sampled choices: choice j is what the request seeded seed + j gives alone.
    kwargs = dict(model=exp["model"], prompt=case["prompt"], max_tokens=12, temperature=1.0, seed=40)
    r = c.completions.create(n=4, **kwargs)
    alone = [c.completions.create(**{**kwargs, "seed": 40 + j}).choices[0].text for j in range(4)]
    check([ch.text for ch in r.choices] == alone, f"sampled choices {[ch.text for ch in r.choices]} vs alone {alone}")
    check(len(set(alone)) > 1, f"four seeds gave one text: {alone}")
    # Streamed: chunks of the choices interleave; each reassembles to its whole text.
    texts, finishes, usage = {}, {}, None
    for chunk in c.completions.create(n=4, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    check([texts.get(j) for j in range(4)] == alone, f"streamed choices {texts}")
    check(sorted(finishes) == [0, 1, 2, 3] and usage and usage.completion_tokens == 48, f"streamed ends {finishes} {usage}")
    # Chat with n.
    chat = exp["chats"][0]
    r = c.chat.completions.create(model=exp["model"], messages=chat["messages"], max_tokens=chat["max_tokens"], temperature=0, n=2)
    check([ch.message.content for ch in r.choices] == [chat["text"]] * 2, f"chat choices {r.choices}")
    # A list of prompts, two choices each.
    two = exp["completions"][:2]
    r = c.completions.create(model=exp["model"], prompt=[x["prompt"] for x in two], max_tokens=case["max_tokens"], temperature=0, n=2)
    check([ch.text for ch in r.choices] == [two[0]["text"]] * 2 + [two[1]["text"]] * 2, f"prompt list {[ch.text for ch in r.choices]}")
    check(r.usage.prompt_tokens == two[0]["prompt_tokens"] + two[1]["prompt_tokens"], f"each prompt counted once: {r.usage}")
    # Echo: the prompt, then the reply.
    r = c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, echo=True)
    check(r.choices[0].text == case["prompt"] + case["text"], f"echo {r.choices[0].text!r}")
    first = next(iter(c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=4, temperature=0, echo=True, stream=True)))
    check(first.choices[0].text == case["prompt"], f"the first streamed chunk echoes the prompt: {first}")
    # Scoring: a greedy continuation's log-probabilities, then the same tokens scored as prompt.
    g = c.completions.create(model=exp["model"], prompt=case["prompt"], max_tokens=8, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    generated = g.choices[0].logprobs
    s = c.completions.create(model=exp["model"], prompt=case["prompt"] + g.choices[0].text, max_tokens=0, echo=True, logprobs=2)
    lp = s.choices[0].logprobs
    n = case["prompt_tokens"]
    check(s.usage.completion_tokens == 0 and s.choices[0].finish_reason == "length", f"scoring generates nothing: {s.usage} {s.choices[0].finish_reason}")
    check(len(lp.tokens) == s.usage.prompt_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, f"one entry per prompt token, the first without: {lp.token_logprobs[:3]}")
    check(all(x is not None and x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:]), "log-probabilities with two alternatives")
    check("".join(lp.tokens) == s.choices[0].text == case["prompt"] + g.choices[0].text, "the tokens spell the echoed text")
    check(lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))], f"offsets {lp.text_offset}")
    check(lp.tokens[n:] == generated.tokens, f"the continuation tokenizes as generated: {lp.tokens[n:]} vs {generated.tokens}")
    scored = lp.token_logprobs[n:]
    worst = max(abs(a - b) for a, b in zip(scored, generated.token_logprobs))
    check(worst < 0.02, f"scored as prompt {scored} vs generated {generated.token_logprobs}: {worst}")
    # Greedy tokens are the most likely: their score is the top alternative's.
    check(all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs[n:], scored)), "greedy tokens score as the top token")


def scenario_queue(url, exp):
    """Past --max-queue waiting requests, new ones get 503 with Retry-After."""
    statuses, retry = [], []

    def run(i):
        got, headers, data = raw(url, "POST", "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 64, "ignore_eos": True, "temperature": 0}, timeout=300)
        statuses.append(got)
        if got == 503:
            retry.append(headers.get("retry-after"))
            check(json.loads(data)["error"]["type"] == "overloaded_error", "503 error type")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(exp["requests"])]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=300)
    check(503 in statuses and 200 in statuses, f"statuses {sorted(statuses)}")
    check(all(r and int(r) >= 1 for r in retry), f"Retry-After {retry}")


def scenario_stream_until_signal(url, exp):
    """Streams one long reply and reports how it ended (the test sends SIGTERM meanwhile)."""
    c = client(url, exp.get("api_key"))
    finish, text = None, ""
    for chunk in c.completions.create(model=exp["model"], prompt="Once upon a time", max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    check(finish == "cancelled", f"the stream ended with {finish!r}")
    check(len(text) > 0, "text before the end")
    print("stream ended:", finish)


def scenario_embeddings(url, exp):
    """Embeddings through the openai client equal the golden ones."""
    c = client(url, exp.get("api_key"))
    r = c.embeddings.create(model=exp["model"], input=exp["sentences"])
    check(len(r.data) == len(exp["sentences"]), "one embedding per input")
    for d, gold in zip(r.data, exp["embeddings"]):
        v = d.embedding
        dot = sum(a * b for a, b in zip(v, gold))
        na = sum(a * a for a in v) ** 0.5
        nb = sum(b * b for b in gold) ** 0.5
        check(dot / (na * nb) >= 0.9999, f"cosine {dot / (na * nb)}")
    r2 = c.embeddings.create(model=exp["model"], input=exp["sentences"][0], encoding_format="base64")
    check(r2.data[0].embedding is not None, "base64 embeddings")
    got, _, data = raw(url, "POST", "/v1/completions", {"prompt": "x"})
    check(got == 400 and "encoder" in json.loads(data)["error"]["message"], "completions on an encoder")


def scenario_embeddings_batched(url, exp):
    """Many inputs in one request: one embedding per input, in order, each
    within cosine 0.9999 of the same input embedded alone (by the
    single-sequence plan), in exactly the model steps the artifact's limits
    imply (the /metrics step counter: ceil(inputs / max_sequences)); one
    input more is one step more, and the same vector as in the batch."""
    c = client(url, exp.get("api_key"))
    steps = lambda: metrics(url).get("maxrun_embedding_steps_total", 0)
    before = steps()
    t0 = time.time()
    r = c.embeddings.create(model=exp["model"], input=exp["inputs"])
    took = time.time() - t0
    check(len(r.data) == len(exp["inputs"]), f"{len(r.data)} embeddings for {len(exp['inputs'])} inputs")
    for i, (d, alone) in enumerate(zip(r.data, exp["alone"])):
        check(d.index == i, f"embedding {i} has index {d.index}")
        cos = cosine(d.embedding, alone)
        check(cos >= 0.9999, f"input {i}: cosine {cos} with the input alone")
    ran = steps() - before
    check(ran == exp["steps"], f"{len(exp['inputs'])} inputs took {ran} steps, not {exp['steps']}")
    check(r.usage.prompt_tokens == exp["tokens"], f"usage {r.usage} for {exp['tokens']} tokens")
    r1 = c.embeddings.create(model=exp["model"], input=exp["inputs"][5])
    check(steps() - before == exp["steps"] + 1, "one input, one step")
    cos = cosine(r1.data[0].embedding, r.data[5].embedding)
    check(cos >= 0.9999, f"input 5 alone: cosine {cos} with it in the batch")
    print(f"{len(exp['inputs'])} inputs in {ran} steps, {took * 1e3:.0f} ms")


def scenario_speculative(url, exp):
    """A server with --speculative: each chat reply, whole and streamed, is
    the text plain decoding gives (what `maxrun --chat` printed), eight
    clients at once; the drafts show on /metrics, some of them standing."""
    c = client(url, exp.get("api_key"))
    before = metrics(url)
    chats = exp["chats"]

    def one(i):
        case = chats[i % len(chats)]
        kw = dict(model=exp["model"], messages=[{"role": "user", "content": case["message"]}], max_tokens=case["max_tokens"], temperature=0)
        if i % 2:
            text = "".join((ch.choices[0].delta.content or "") for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
        else:
            text = c.chat.completions.create(**kw).choices[0].message.content
        check(text == case["text"], f"chat {i % len(chats)}: {text!r} is not plain decoding's {case['text']!r}")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(2 * len(chats))))
    after = metrics(url)
    drafted = after["maxrun_spec_decode_draft_tokens_total"] - before.get("maxrun_spec_decode_draft_tokens_total", 0)
    accepted = after["maxrun_spec_decode_accepted_tokens_total"] - before.get("maxrun_spec_decode_accepted_tokens_total", 0)
    verifications = after["maxrun_spec_decode_verifications_total"] - before.get("maxrun_spec_decode_verifications_total", 0)
    check(drafted > 0 and 0 < accepted <= drafted, f"drafted {drafted}, accepted {accepted}")
    check(after["maxrun_spec_decode_accepted_length_count"] == verifications + before.get("maxrun_spec_decode_accepted_length_count", 0), "one accepted length per verification")
    print(f"{drafted:.0f} drafted, {accepted:.0f} accepted, {verifications:.0f} verifications")


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": S, "country": S, "population": {"type": "integer", "minimum": 0}}, "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}}, "required": ["title", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "string", "enum": ["light", "dark"]}}, "required": ["color", "shade"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "celsius"}}, "required": ["temperature", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}, "event": S}, "required": ["date", "event"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}, "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999}, {"type": "string", "pattern": "^id-[a-z]{3}$"}]}}, "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"], "additionalProperties": False}, "job": S}, "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}, "minItems": 2, "maxItems": 3}}, "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": S}, "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}, "comment": {"type": ["string", "null"], "maxLength": 20}}, "required": ["score", "comment"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"nickname": S, "hobby": S}, "required": [], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "detail": {"oneOf": [{"type": "object", "properties": {"code": {"type": "integer", "minimum": 100, "maximum": 599}}, "required": ["code"], "additionalProperties": False}, {"type": "null"}]}}, "required": ["status", "detail"], "additionalProperties": False},
    {"type": "object", "properties": {"uuid": {"type": "string", "format": "uuid"}}, "required": ["uuid"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8, "pattern": "^[a-z]+$"}, "count": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}, "required": ["word", "count"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object", "properties": {"name": S, "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["name", "price"], "additionalProperties": False}}, "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
]


def scenario_structured(url, exp):
    """20 JSON schemas, greedy and sampled: every reply parses and validates
    (jsonschema is the judge); json_object gives JSON; a broken grammar is a 400."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    check(len(SCHEMAS) == 20, "twenty schemas")
    for i, schema in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        for temperature, seed in ((0, 0), (0.8, i + 1)):
            r = c.chat.completions.create(
                model=exp["model"],
                messages=[{"role": "user", "content": "Reply with a JSON value that fits this schema: " + json.dumps(schema)}],
                temperature=temperature,
                seed=seed,
                max_tokens=400,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            )
            text = r.choices[0].message.content
            check(r.choices[0].finish_reason == "stop", f"schema {i} at {temperature}: finish {r.choices[0].finish_reason}: {text!r}")
            try:
                value = json.loads(text)
            except ValueError as e:
                raise AssertionError(f"schema {i} at {temperature}: not JSON ({e}): {text!r}")
            try:
                jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
            except jsonschema.ValidationError as e:
                raise AssertionError(f"schema {i} at {temperature}: {text!r} does not validate: {e.message}")
    # Completions take the same field, and the vLLM-style extensions.
    r = c.completions.create(model=exp["model"], prompt="The year the first moon landing happened:", max_tokens=10, temperature=0, extra_body={"guided_regex": " [0-9]{4}"})
    check(len(r.choices[0].text.strip()) == 4 and r.choices[0].text.strip().isdigit(), f"guided_regex: {r.choices[0].text!r}")
    r = c.completions.create(model=exp["model"], prompt="Answer yes or no: is water wet?", max_tokens=5, temperature=0, extra_body={"guided_grammar": 'start: " " ("yes" | "no")'})
    check(r.choices[0].text in (" yes", " no"), f"guided_grammar: {r.choices[0].text!r}")
    for messages in (
        [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}],
        [{"role": "user", "content": "Give a JSON object with one key, fruit, naming a fruit."}],
    ):
        r = c.chat.completions.create(model=exp["model"], messages=messages, temperature=0, max_tokens=300, response_format={"type": "json_object"})
        v = json.loads(r.choices[0].message.content)
        check(isinstance(v, dict), f"json_object: {v!r}")
    for body, param in (
        ({"messages": [{"role": "user", "content": "x"}], "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(unclosed"}, "guided_regex"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ):
        got, _, data = raw(url, "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {exp.get('api_key')}"} if exp.get("api_key") else {})
        err = json.loads(data)["error"]
        check(got == 400 and err["param"] == param, f"{body}: {got} {err}")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a time zone", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"], "additionalProperties": False}}}


def scenario_tools(url, exp):
    """Required and named tool choices give calls whose arguments validate; a
    two-turn exchange completes; streamed deltas reassemble (the client's own
    helper) to the same calls."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    tools = {"get_weather": WEATHER, "get_time": TIME}
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for temperature in (0, 0.9):
            r = c.chat.completions.create(model=exp["model"], messages=question, tools=list(tools.values()), tool_choice=choice, temperature=temperature, seed=5, max_tokens=200)
            m = r.choices[0].message
            # OpenAI ends a reply forced to a named function with "stop", and one
            # the model was required to make with "tool_calls".
            check(r.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls") and m.tool_calls, f"{choice}: {r.choices[0]}")
            if isinstance(choice, dict):
                check(len(m.tool_calls) == 1, f"a named choice makes exactly one call: {m.tool_calls}")
            for call in m.tool_calls:
                if isinstance(choice, dict):
                    check(call.function.name == "get_time", f"named choice: {call.function.name}")
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, tools[call.function.name]["function"]["parameters"])
                check(call.id and call.type == "function", "call id and type")
    # Streamed, reassembled by the client's helper: the same calls as the whole response.
    kwargs = dict(model=exp["model"], messages=question, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200)
    whole = c.chat.completions.create(**kwargs).choices[0].message
    with c.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    check(final.choices[0].finish_reason == "tool_calls", f"streamed finish {final.choices[0].finish_reason}")
    check([(t.function.name, json.loads(t.function.arguments)) for t in streamed.tool_calls] == [(t.function.name, json.loads(t.function.arguments)) for t in whole.tool_calls], f"streamed {streamed.tool_calls} vs {whole.tool_calls}")
    # Two turns: the call, the tool's result, then an answer in words.
    call = whole.tool_calls[0]
    messages = question + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "clear"})},
    ]
    r = c.chat.completions.create(model=exp["model"], messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=60)
    check(r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length"), f"final answer: {r.choices[0]}")
    check(r.usage.prompt_tokens > 60, "the exchange went back through the template")
    # auto: whatever the model chooses, the response is well formed.
    r = c.chat.completions.create(model=exp["model"], messages=question, tools=[WEATHER], temperature=0, max_tokens=80)
    m = r.choices[0].message
    check((m.tool_calls and r.choices[0].finish_reason == "tool_calls") or (m.content is not None and not m.tool_calls), f"auto: {r.choices[0]}")
    # Bad tool requests.
    auth = {"Authorization": f"Bearer {exp['api_key']}"} if exp.get("api_key") else {}
    for body, param in (
        ({"messages": question, "tool_choice": "required"}, "tool_choice"),
        ({"messages": question, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": question, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"messages": question, "tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"messages": question, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ):
        got, _, data = raw(url, "POST", "/v1/chat/completions", body, auth)
        err = json.loads(data)["error"]
        check(got == 400 and err["param"] == param, f"{body}: {got} {err}")


def close_everywhere(schema):
    """The schema as OpenAI's strict mode reads it: additionalProperties false
    added to every object that declares properties and does not say it
    (written here, apart from the server's code, as the judge)."""
    if isinstance(schema, list):
        return [close_everywhere(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else close_everywhere(v)) for k, v in schema.items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


SHORT = {"type": "string", "maxLength": 16}
# The issue's schema, nested: objects in properties, in items, in anyOf and in
# $defs, none of them saying additionalProperties.
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "object", "properties": {"name": SHORT, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}, "required": ["name", "population"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "landmarks": {"type": "array", "items": {"type": "object", "properties": {"title": SHORT, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title"]}, "maxItems": 2},
        "mayor": {"anyOf": [{"type": "object", "properties": {"name": SHORT, "party": SHORT}, "required": ["name"]}, {"type": "null"}]},
        "country": {"$ref": "#/$defs/country"},
    },
    "required": ["city", "tags", "mayor", "country"],
    "$defs": {"country": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}, "name": SHORT}, "required": ["code"]}},
}


def scenario_strict(url, exp):
    """OpenAI's strict semantics: objects whose schema omits
    additionalProperties take only their declared properties, strict and not,
    over 20 seeds at temperature 0.9 (each reply judged by jsonschema against
    the schema closed everywhere); additionalProperties with a schema still
    allows more; schemas that cannot be honoured are 400s naming the keyword."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    auth = {"Authorization": f"Bearer {exp['api_key']}"} if exp.get("api_key") else {}
    judge = jsonschema.Draft202012Validator(close_everywhere(NESTED), format_checker=jsonschema.FormatChecker())
    check(judge.schema["properties"]["city"]["additionalProperties"] is False and judge.schema["$defs"]["country"]["additionalProperties"] is False, "the judge is closed")
    messages = [{"role": "user", "content": "Describe a city you like as JSON, with as many extra facts as you can: its name, population, density, tags, landmarks, mayor and country."}]
    results, errors = {}, []

    def one(seed, strict):
        try:
            fmt = {"name": "city", "schema": NESTED}
            if strict is not None:
                fmt["strict"] = strict
            r = c.chat.completions.create(model=exp["model"], messages=messages, temperature=0.9, seed=seed, max_tokens=400, response_format={"type": "json_schema", "json_schema": fmt})
            results[(seed, strict)] = (r.choices[0].finish_reason, r.choices[0].message.content)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"seed {seed}: {e!r}")

    runs = [(seed, True) for seed in range(20)] + [(seed, None) for seed in range(100, 105)] + [(seed, False) for seed in range(200, 205)]
    for batch in range(0, len(runs), 10):
        threads = [threading.Thread(target=one, args=run) for run in runs[batch:batch + 10]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    check(not errors, f"errors: {errors}")
    check(len(results) == len(runs), f"{len(results)} of {len(runs)} replies")
    for (seed, strict), (finish, text) in sorted(results.items(), key=lambda kv: (str(kv[0][1]), kv[0][0])):
        check(finish == "stop", f"seed {seed} (strict {strict}): finish {finish}: {text!r}")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"seed {seed} (strict {strict}): not JSON ({e}): {text!r}")
        problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in judge.iter_errors(value)]
        check(not problems, f"seed {seed} (strict {strict}): {text!r}: {problems}")
    print(f"strict: {len(results)} replies, all with only declared properties")
    # An object that says what else it takes still takes more: two properties
    # at least where one is declared, so the reply must add one.
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
                   "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "minProperties": 2, "maxProperties": 2}
    r = c.chat.completions.create(model=exp["model"], messages=[{"role": "user", "content": "Two digits as JSON, under the keys a and b."}], temperature=0, max_tokens=60,
                                  response_format={"type": "json_schema", "json_schema": {"name": "open", "schema": open_schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, open_schema)
    check(len(value) == 2 and "a" in value, f"an open object took another property: {value}")
    # Schemas that cannot be honoured: 400 naming the field, the message the keyword.
    q = [{"role": "user", "content": "x"}]
    for body, param, words in (
        ({"messages": q, "response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": {"type": "object", "properties": {"a": {}}, "minProperties": 2}}}}, "response_format", ("minProperties", "additionalProperties")),
        ({"messages": q, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": True, "schema": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}}}, "response_format", ("required", "`b`")),
        ({"messages": q, "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}}}}, "response_format", ("unevaluatedProperties",)),
        ({"messages": q, "guided_json": {"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {}}, "additionalProperties": 7}}}}, "guided_json", ("additionalProperties", "#/properties/p")),
        ({"messages": q, "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[1].function.parameters", ("required",)),
    ):
        got, _, data = raw(url, "POST", "/v1/chat/completions", body, auth)
        err = json.loads(data)["error"]
        check(got == 400 and err["param"] == param and all(w in err["message"] for w in words), f"{body}: {got} {err}")


def scenario_tool_choice(url, exp):
    """A named tool choice makes exactly one call of that tool, whole and
    streamed (its arguments streamed in pieces, as OpenAI's); required makes at
    least one, exactly one with parallel_tool_calls false; with auto, a reply
    of two calls comes back as one when parallel_tool_calls is false."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    tools = [WEATHER, TIME]
    question = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo? Call both tools, several times if you like."}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        kwargs = dict(model=exp["model"], messages=question, tools=tools, tool_choice=named, temperature=0.9, seed=seed, max_tokens=200)
        whole = c.chat.completions.create(**kwargs).choices[0]
        calls = whole.message.tool_calls or []
        check(len(calls) == 1 and calls[0].function.name == "get_weather", f"named, seed {seed}: {calls}")
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
        check(whole.finish_reason == "stop", f"named finish {whole.finish_reason}")
        # Streamed: the chunks as OpenAI sends them, and the same single call.
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        check(deltas[0].role == "assistant" and deltas[0].content is None and deltas[0].tool_calls, f"the first chunk opens with the call: {deltas[0]}")
        pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
        heads = [tc for tc in pieces if tc.id]
        check(len(heads) == 1 and heads[0].function.name == "get_weather" and heads[0].type == "function" and heads[0].function.arguments == "", f"one head: {heads}")
        check({tc.index for tc in pieces} == {0}, f"one call index: {pieces}")
        args = "".join(tc.function.arguments or "" for tc in pieces)
        check(json.loads(args) == json.loads(calls[0].function.arguments), f"streamed arguments {args!r} vs {calls[0].function.arguments!r}")
        check(len([tc for tc in pieces if tc.function.arguments]) > 1, f"the arguments came in pieces: {pieces}")
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        check(finishes == ["stop"], f"streamed finish {finishes}")
        check(all(not d.content for d in deltas), f"no content beside the call: {deltas}")
        with c.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        check(len(final.choices[0].message.tool_calls) == 1, f"the client's helper sees one call: {final.choices[0].message.tool_calls}")
    # required: at least one call; with parallel_tool_calls false exactly one.
    for parallel in (None, False):
        for seed in range(3):
            kwargs = dict(model=exp["model"], messages=question, tools=tools, tool_choice="required", temperature=0.9, seed=seed, max_tokens=300)
            if parallel is not None:
                kwargs["parallel_tool_calls"] = parallel
            r = c.chat.completions.create(**kwargs).choices[0]
            n = len(r.message.tool_calls or [])
            check(n >= 1 if parallel is None else n == 1, f"required, parallel {parallel}, seed {seed}: {n} calls")
            check(r.finish_reason == "tool_calls", f"required finish {r.finish_reason}")
            names = [tc.function.name for tc in (r.message.tool_calls or [])]
            streamed = c.chat.completions.create(stream=True, **kwargs)
            heads = [tc.function.name for ch in streamed if ch.choices for tc in (ch.choices[0].delta.tool_calls or []) if tc.id]
            check(heads == names, f"streamed calls {heads} vs {names}")
    # auto: a reply that is two calls (held to them by a grammar) is two calls,
    # or one with parallel_tool_calls false, whole and streamed.
    two = ('start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>\\n'
           '<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"Asia/Tokyo\\"}}\\n</tool_call>"')
    for parallel, want in ((None, ["get_weather", "get_time"]), (True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        kwargs = dict(model=exp["model"], messages=question, tools=tools, temperature=0, max_tokens=100, extra_body={"guided_grammar": two})
        if parallel is not None:
            kwargs["parallel_tool_calls"] = parallel
        r = c.chat.completions.create(**kwargs).choices[0]
        check([tc.function.name for tc in (r.message.tool_calls or [])] == want and r.finish_reason == "tool_calls", f"auto, parallel {parallel}: {r}")
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        heads = [tc.function.name for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or []) if tc.id]
        check(heads == want, f"auto streamed, parallel {parallel}: {heads}")
        check([ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"], "auto streamed finish")


def scenario_tokenize(url, exp):
    """/tokenize and /detokenize as vLLM shapes them: the ids of the
    tokenizers crate (and transformers' goldens) for the same text, chat
    messages through the template as transformers renders them, ids back to
    text; bad requests are 400s naming the field."""
    auth = {"Authorization": f"Bearer {exp['api_key']}"} if exp.get("api_key") else {}

    def post(path, body, headers=auth):
        got, _, data = raw(url, "POST", path, body, headers)
        return got, json.loads(data)

    for case in exp["texts"]:
        got, v = post("/tokenize", {"model": exp["model"], "prompt": case["text"], "return_token_strs": True})
        check(got == 200, f"{case['text']!r}: {got} {v}")
        check(v["tokens"] == case["ids"], f"{case['text']!r}: {v['tokens']} != {case['ids']}")
        check(v["count"] == len(case["ids"]) and v["max_model_len"] == exp["max_length"], f"count / max_model_len {v}")
        check(v["token_strs"] == case["token_strs"], f"token strings {v['token_strs']} != {case['token_strs']}")
        got, v = post("/tokenize", {"prompt": case["text"], "add_special_tokens": False})
        check(got == 200 and v["tokens"] == case["ids_plain"] and "token_strs" not in v, f"without special tokens: {v}")
        got, v = post("/detokenize", {"model": exp["model"], "tokens": case["ids"]})
        check(got == 200 and v == {"prompt": case["decoded"]}, f"detokenize {case['ids']}: {v}")
        check(case["decoded"] == case["text"], f"the round trip gives the text back: {case['decoded']!r}")
    for case in exp["golden"]:
        got, v = post("/tokenize", {"prompt": case["prompt"]})
        check(v["tokens"] == case["input_ids"], f"transformers' ids for {case['prompt']!r}: {v['tokens']} != {case['input_ids']}")
    chat = exp["chat"]
    got, v = post("/tokenize", {"messages": chat["messages"]})
    check(got == 200 and v["tokens"] == chat["input_ids"], f"the chat template as transformers applies it: {v} != {chat['input_ids']}")
    got, v = post("/tokenize", {"messages": chat["messages"], "add_generation_prompt": False})
    check(v["tokens"] == chat["without_generation_prompt"], f"without the generation prompt: {v['tokens']}")
    got, v = post("/detokenize", {"tokens": chat["input_ids"]})
    check(v["prompt"] == chat["decoded"], f"chat ids back to the template's text: {v['prompt']!r}")
    # With tools, the messages render as a chat request with those tools does.
    c = client(url, exp.get("api_key"))
    r = c.chat.completions.create(model=exp["model"], messages=chat["messages"], tools=[WEATHER], max_tokens=1, temperature=0)
    got, v = post("/tokenize", {"messages": chat["messages"], "tools": [WEATHER]})
    check(v["count"] == r.usage.prompt_tokens and v["count"] > len(chat["input_ids"]), f"with tools: {v['count']} vs {r.usage.prompt_tokens}")
    got, v = post("/detokenize", {"tokens": []})
    check(got == 200 and v == {"prompt": ""}, f"no tokens: {v}")
    for path, body, status, param in (
        ("/tokenize", {"prompt": "hi", "content": "hi"}, 400, "content"),
        ("/tokenize", {"prompt": "hi", "messages": chat["messages"]}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
        ("/detokenize", {"tokens": [1, exp["vocab"]]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 2], "skip_special_tokens": True}, 400, "skip_special_tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ):
        got, v = post(path, body)
        err = v.get("error", {})
        check(got == status and set(err) == {"message", "type", "param", "code"} and err["message"], f"{path} {body}: {got} {v}")
        check(err["param"] == param, f"{path} {body}: param {err['param']!r}, want {param!r}")
    got, v = post("/detokenize", {"tokens": [1, -3]})
    check(got == 400 and v["error"]["param"].startswith("tokens"), f"a negative id: {got} {v}")
    got, v = post("/detokenize", {"tokens": [1, exp["vocab"] + 7]})
    check(str(exp["vocab"] + 7) in v["error"]["message"] and "tokens[1]" in v["error"]["message"], f"the id and its place: {v}")
    if exp.get("api_key"):
        got, _ = post("/tokenize", {"prompt": "hi"}, {})
        check(got == 401, f"no key: {got}")


def streamed_reasoning(c, kwargs):
    """A streamed chat's `reasoning_content` deltas and `content` deltas, each in order."""
    r_parts, c_parts = [], []
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            if extra.get("reasoning_content"):
                r_parts.append(extra["reasoning_content"])
            if ch.delta.content:
                c_parts.append(ch.delta.content)
    return r_parts, c_parts


def scenario_reasoning(url, exp):
    """With a reasoning parser, <think>...</think> goes to reasoning_content,
    whole and streamed (the reply is held to that shape by a grammar)."""
    c = client(url, exp.get("api_key"))
    grammar = 'start: "<think>" /[a-z ]{5,40}/ "</think>" /[A-Z][a-z ]{3,30}\\./'
    kwargs = dict(model=exp["model"], messages=[{"role": "user", "content": "Think, then answer: what color is the sky?"}], temperature=0, max_tokens=80, extra_body={"guided_grammar": grammar})
    m = c.chat.completions.create(**kwargs).choices[0].message
    reasoning = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")
    check(reasoning and "<think>" not in reasoning and "</think>" not in reasoning, f"reasoning {reasoning!r}")
    check(m.content and m.content[0].isupper() and "think>" not in m.content, f"content {m.content!r}")
    r_parts, c_parts = streamed_reasoning(c, kwargs)
    check("".join(r_parts) == reasoning and "".join(c_parts) == m.content, f"streamed {''.join(r_parts)!r} / {''.join(c_parts)!r}")
    check(len(r_parts) > 1, "the reasoning streamed in pieces")
    # SGLang's fields: separate_reasoning false leaves the thinking in the
    # content; stream_reasoning false sends it as one delta.
    kept = c.chat.completions.create(**{**kwargs, "extra_body": {"guided_grammar": grammar, "separate_reasoning": False}}).choices[0].message
    check(not (kept.model_extra or {}).get("reasoning_content"), f"separate_reasoning false: reasoning {kept.model_extra}")
    check(kept.content.startswith("<think>") and reasoning.strip() in kept.content and kept.content.endswith(m.content), f"separate_reasoning false: content {kept.content!r}")
    r_parts, c_parts = streamed_reasoning(c, {**kwargs, "extra_body": {"guided_grammar": grammar, "stream_reasoning": False}})
    check(r_parts == [reasoning] and "".join(c_parts) == m.content, f"stream_reasoning false: {r_parts!r} / {''.join(c_parts)!r}")


# What sglang-router 0.3.2 adds to each request it forwards (captured from it).
def scenario_harmony(url, exp):
    """gpt-oss's harmony replies (a template in the harmony layout makes the
    server read them so): the analysis channel comes back as
    reasoning_content and the final channel as content, whole and streamed,
    no marker in either; a required call to functions.NAME as tool_calls,
    whole and streamed the same; its result goes back through the template.
    Replies are held to those shapes by a grammar and by tool_choice."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    grammar = 'start: "<|channel|>analysis<|message|>" /[a-z ]{5,30}/ "<|end|><|start|>assistant<|channel|>final<|message|>" /[A-Z][a-z ]{3,20}\\./'
    kwargs = dict(model=exp["model"], messages=[{"role": "user", "content": "Think, then answer: what color is the sky?"}], temperature=0, max_tokens=80, extra_body={"guided_grammar": grammar})
    m = c.chat.completions.create(**kwargs).choices[0].message
    reasoning = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")
    check(reasoning and "<|" not in reasoning and len(reasoning.strip()) >= 5, f"reasoning {reasoning!r}")
    check(m.content and m.content[0].isupper() and m.content.endswith(".") and "<|" not in m.content, f"content {m.content!r}")
    r_parts, c_parts = streamed_reasoning(c, kwargs)
    check("".join(r_parts) == reasoning and "".join(c_parts) == m.content, f"streamed {''.join(r_parts)!r} / {''.join(c_parts)!r}")
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kw = dict(model=exp["model"], messages=question, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200)
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    check(r.choices[0].finish_reason == "tool_calls" and m.tool_calls and [t.function.name for t in m.tool_calls] == ["get_weather"], f"required: {r.choices[0]}")
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    check(not m.content, f"a call and no text: {m.content!r}")
    with c.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    got = [(t.function.name, json.loads(t.function.arguments)) for t in final.choices[0].message.tool_calls]
    check(got == [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] and final.choices[0].finish_reason == "tool_calls", f"streamed {got} vs {m.tool_calls}")
    call = m.tool_calls[0]
    messages = question + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    r = c.chat.completions.create(model=exp["model"], messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20)
    check(r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls, f"after the result: {r.choices[0]}")
    check(r.usage.prompt_tokens > len(json.dumps(messages)) // 8, f"the exchange went back through the template: {r.usage}")


SGLANG_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
SGLANG_COMPLETION_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}


def scenario_router_fields(url, exp):
    """The fields routers and vLLM / SGLang clients add: accepted at their
    defaults without --allow-extra-request-fields, honoured where they mean
    something (stop strings kept, special tokens skipped, the final message
    continued), refused by name where they cannot be (hidden states); the
    model `unknown` sglang-router writes for a request without one; SGLang's
    /server_info and /model_info; vLLM's gauges at known moments."""
    model, g = exp["model"], exp["greedy"]
    c = client(url, None)
    check([m.id for m in c.models.list().data] == [model] and " " not in model, f"the served id {model!r}")
    # Bodies as sglang-router forwards them, with and without a model.
    for body in ({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "stream": False, **SGLANG_CHAT_FIELDS},
                 {"model": "unknown", "messages": [{"role": "user", "content": "Hi"}], "stream": False, "max_completion_tokens": 2, **SGLANG_CHAT_FIELDS}):
        status, _, out = raw(url, "POST", "/v1/chat/completions", body)
        check(status == 200 and json.loads(out)["model"] == model, f"router chat body {body['model']}: {status} {out[:300]}")
    status, _, out = raw(url, "POST", "/v1/completions", {"model": "unknown", "prompt": g["prompt"], "max_tokens": 24, "temperature": 0, "stream": False, **SGLANG_COMPLETION_FIELDS})
    check(status == 200 and json.loads(out)["choices"][0]["text"] == g["text"], f"router completion body: {status} {out[:300]}")
    status, _, out = raw(url, "POST", "/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 1})
    check(status == 404, f"another model: {status}")
    for name, value in (("return_hidden_states", True), ("frobnicate", 1)):
        status, _, out = raw(url, "POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1, name: value})
        check(status == 400 and json.loads(out)["error"]["param"] == name, f"{name}: {status} {out[:300]}")
    # A stop string from the middle of the greedy reply: cut before it by
    # default, kept with no_stop_trim (SGLang) / include_stop_str_in_output (vLLM).
    text = g["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    before = text[: text.index(stop)]
    kw = dict(model=model, prompt=g["prompt"], max_tokens=24, temperature=0, stop=[stop])
    check(c.completions.create(**kw).choices[0].text == before, "the stop string is cut")
    for field in ("no_stop_trim", "include_stop_str_in_output"):
        r = c.completions.create(**kw, extra_body={field: True})
        check(r.choices[0].text == before + stop and r.choices[0].finish_reason == "stop", f"{field}: {r.choices[0].text!r}, want {before + stop!r}")
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True, extra_body={field: True}) if ch.choices)
        check(streamed == before + stop, f"{field} streamed: {streamed!r}")
    # Special tokens: <|im_start|> forced first by logit_bias gives its text
    # unless skip_special_tokens.
    special = exp["special_token"]
    kw = dict(model=model, prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(special["id"]): 100})
    shown = c.completions.create(**kw).choices[0].text
    check(shown == special["text"], f"the special token's text {shown!r}")
    skipped = c.completions.create(**kw, extra_body={"skip_special_tokens": True}).choices[0].text
    check(skipped == "", f"skip_special_tokens: {skipped!r}")
    check(c.completions.create(**kw, extra_body={"spaces_between_special_tokens": False}).choices[0].text == shown, "spaces_between_special_tokens is accepted")
    # continue_final_message: the reply continues the assistant's words, as a
    # completion of the template's rendering cut after them does.
    start = "The capital of France is"
    messages = [{"role": "user", "content": "Say something about France."}, {"role": "assistant", "content": start}]
    status, _, out = raw(url, "POST", "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": False})
    check(status == 200, f"/tokenize: {status} {out[:200]}")
    status, _, out = raw(url, "POST", "/detokenize", {"model": model, "tokens": json.loads(out)["tokens"]})
    rendered = json.loads(out)["prompt"]
    cut = rendered[: rendered.rindex(start) + len(start)]
    want = c.completions.create(model=model, prompt=cut, max_tokens=8, temperature=0, extra_body={"add_special_tokens": False})
    got = c.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"continue_final_message": True})
    check(got.choices[0].message.content == want.choices[0].text, f"continued {got.choices[0].message.content!r}, want {want.choices[0].text!r}")
    check(got.usage.prompt_tokens == want.usage.prompt_tokens, f"continued prompt {got.usage.prompt_tokens} tokens, want {want.usage.prompt_tokens}")
    status, _, out = raw(url, "POST", "/v1/chat/completions", {"model": model, "messages": messages[:1], "continue_final_message": True})
    check(status == 400 and json.loads(out)["error"]["param"] == "continue_final_message", f"continuing a user message: {status} {out[:200]}")
    # SGLang's info endpoints, which sglang-router reads.
    for path in ("/server_info", "/get_server_info"):
        status, _, out = raw(url, "GET", path)
        info = json.loads(out)
        check(status == 200 and info["served_model_name"] == model and info["context_length"] == exp["max_length"], f"{path}: {status} {out[:300]}")
    status, _, out = raw(url, "GET", "/model_info")
    check(status == 200 and json.loads(out)["is_generation"] is True, f"/model_info: {out[:200]}")
    # vLLM's gauges: idle, then with one stream running, against maxrun's own.
    m = metrics(url)
    check(m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, f"idle gauges {m}")
    total = m["maxrun_kv_blocks_used"] + m["maxrun_kv_blocks_free"]
    config = [k for k in m if k.startswith("vllm:cache_config_info")]
    check(config == [f"vllm:cache_config_info{{block_size={exp['block_size']},num_gpu_blocks={int(total)}}}"] and m[config[0]] == 1, f"cache config {config}, {total} blocks")
    stream = c.completions.create(model=model, prompt="Once upon a time", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    m = metrics(url)
    used = m["maxrun_kv_blocks_used"]
    check(m["vllm:num_requests_running"] == 1 and used >= 1 and abs(m["vllm:kv_cache_usage_perc"] - used / total) < 1e-9, f"gauges with a stream running: {m}")
    stream.close()


SYSTEM_PROMPT = " ".join([
    "You are the help desk assistant of a small public library in a river town.",
    "You answer questions about opening hours, borrowing rules, the reading room, events for children, the local history archive and the computers patrons may use.",
    "Keep every answer short and friendly, say when you do not know, and never invent a book, a date or a rule.",
    "The library opens at nine in the morning and closes at six in the evening on weekdays, and at one in the afternoon on Saturdays.",
    "Patrons may borrow up to eight books for three weeks, renew them twice unless someone else has asked for them, and return them through the slot by the door at any hour.",
    "The reading room is quiet, the archive needs an appointment, and the children's corner holds a story hour every Wednesday at four.",
    "Printing costs ten cents a page, the wireless network needs no password, and lost cards are replaced at the front desk for two dollars.",
])
WORDS = "river book card hour rule story archive printer window table chair map letter photo winter summer school bridge garden lamp clock ticket shelf".split()


def session_turns(session, turns):
    """The user turns of one session: 20-40 tokens each, different per session."""
    out = []
    for t in range(turns):
        k = (session * 7 + t * 13) % 11
        words = " ".join(WORDS[(session * 5 + t * 3 + i * 7) % len(WORDS)] for i in range(10 + k))
        out.append(f"Question {t + 1} from patron {session}: what can you tell me about the {words}?")
    return out


def scenario_sessions(url, exp):
    """Chat sessions as an application sends them: `sessions` sessions of
    `turns` turns sharing one system prompt, each turn resending the whole
    conversation, `concurrency` sessions at a time, greedy replies of
    `reply_tokens` tokens, streamed; prints the time to first token p50 / p99
    and the requests as JSON. Every request must succeed."""
    c = client(url, None)
    ttfts, lock = [], threading.Lock()

    def run(session):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for user in session_turns(session, exp["turns"]):
            messages.append({"role": "user", "content": user})
            started, first, parts = time.monotonic(), None, []
            for chunk in c.chat.completions.create(model=exp["model"], messages=messages, max_tokens=exp["reply_tokens"], temperature=0, stream=True):
                for ch in chunk.choices:
                    if ch.delta.content:
                        first = first or time.monotonic()
                        parts.append(ch.delta.content)
            with lock:
                ttfts.append((first or time.monotonic()) - started)
            messages.append({"role": "assistant", "content": "".join(parts)})

    with concurrent.futures.ThreadPoolExecutor(exp["concurrency"]) as pool:
        for f in [pool.submit(run, s) for s in range(exp["sessions"])]:
            f.result()
    ttfts.sort()
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]
    print(json.dumps({"requests": len(ttfts), "ttft_p50_ms": round(q(0.5) * 1000, 1), "ttft_p99_ms": round(q(0.99) * 1000, 1)}))


RESP_WEATHER = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"], "parameters": WEATHER["function"]["parameters"], "strict": True}
RESP_TIME = {"type": "function", "name": "get_time", "description": TIME["function"]["description"], "parameters": TIME["function"]["parameters"], "strict": True}


def response_events_in_order(events):
    """Checks a Responses API stream against the order OpenAI sends: created,
    in_progress, then for each output item its added event, its content
    part's added, its deltas, their done, the part's done and the item's done,
    then one last completed or incomplete event carrying the response; every
    event numbered by sequence_number from 0; each item's deltas concatenate
    to its done text and to the text in the final response. Returns that."""
    types = [e.type for e in events]
    check(types[:2] == ["response.created", "response.in_progress"], f"the stream opens with {types[:2]}")
    check([e.sequence_number for e in events] == list(range(len(events))), f"sequence numbers {[e.sequence_number for e in events]}")
    check(types[-1] in ("response.completed", "response.incomplete") and types.count(types[-1]) == 1, f"the stream ends with {types[-1]}: {types}")
    final = events[-1].response
    check(events[0].response.id == final.id and events[0].response.status == "in_progress" and final.status in ("completed", "incomplete"), f"statuses {events[0].response.status} -> {final.status}")
    i = 2

    def take(kind, item_id):
        nonlocal i
        parts = []
        while events[i].type == kind:
            check(events[i].item_id == item_id, f"{kind} of another item: {events[i]}")
            parts.append(events[i].delta)
            i += 1
        return "".join(parts)

    for index, item in enumerate(final.output):
        e = events[i]
        check(e.type == "response.output_item.added" and e.output_index == index and e.item.id == item.id and e.item.status == "in_progress", f"item {index} opens: {e}")
        i += 1
        if item.type == "message":
            check(events[i].type == "response.content_part.added" and events[i].part.type == "output_text", f"its part opens: {events[i]}")
            i += 1
            text = take("response.output_text.delta", item.id)
            check(events[i].type == "response.output_text.done" and events[i].text == text == item.content[0].text, f"output_text.done {events[i]} vs deltas {text!r}")
            i += 1
            check(events[i].type == "response.content_part.done" and events[i].part.text == text, f"content_part.done {events[i]}")
            i += 1
        elif item.type == "function_call":
            arguments = take("response.function_call_arguments.delta", item.id)
            check(events[i].type == "response.function_call_arguments.done" and events[i].arguments == arguments == item.arguments, f"arguments.done {events[i]} vs deltas {arguments!r}")
            i += 1
        elif item.type == "reasoning":
            check(events[i].type == "response.content_part.added", f"its part opens: {events[i]}")
            i += 1
            text = take("response.reasoning_text.delta", item.id)
            check(events[i].type == "response.reasoning_text.done" and events[i].text == text, f"reasoning_text.done {events[i]}")
            i += 2
        else:
            raise AssertionError(f"an output item of type {item.type}")
        check(events[i].type == "response.output_item.done" and events[i].output_index == index and events[i].item.model_dump() == item.model_dump(), f"item {index} closes as the response lists it: {events[i]}")
        i += 1
    check(i == len(events) - 1, f"events after the last item: {types[i:]}")
    return final


def scenario_responses(url, exp):
    """POST /v1/responses through client.responses.create: plain text equal to
    maxrun --chat's, whole and streamed (the events in OpenAI's order, deltas
    concatenating to the text), max_output_tokens cutting a response
    (incomplete), instructions as the system message (the ids /tokenize gives
    those messages), a function call round trip with function_call_output and
    previous_response_id (the same as sending the whole conversation, and as
    Chat Completions with the same messages), a named tool choice streamed,
    text.format json_schema (jsonschema the judge) and json_object, GET and
    DELETE of stored responses, store false, a missing previous response (404)
    and unsupported fields (400 naming them)."""
    import jsonschema
    c = client(url, exp.get("api_key"))
    m = exp["model"]
    auth = {"Authorization": f"Bearer {exp['api_key']}"} if exp.get("api_key") else {}
    chat = exp["chat"]
    kwargs = dict(model=m, input=chat["messages"], max_output_tokens=chat["max_tokens"], temperature=0)
    r = c.responses.create(**kwargs)
    check(r.object == "response" and r.id.startswith("resp_") and r.model == m and r.created_at > 1e9, f"the response object {r}")
    check(r.output_text == chat["text"], f"responses: {r.output_text!r} != maxrun --chat's {chat['text']!r}")
    check(r.status == ("completed" if chat["finish_reason"] == "stop" else "incomplete"), f"status {r.status}")
    check(len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant" and r.output[0].id.startswith("msg_"), f"output {r.output}")
    u = r.usage
    check(u.input_tokens == chat["prompt_tokens"] and u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens <= u.input_tokens, f"usage {u}")
    if len(chat["messages"]) == 1 and chat["messages"][0]["role"] == "user":
        s = c.responses.create(**{**kwargs, "input": chat["messages"][0]["content"]})
        check(s.output_text == chat["text"], f"a string input is one user message: {s.output_text!r}")
    final = response_events_in_order(list(c.responses.create(stream=True, **kwargs)))
    check(final.output_text == chat["text"] and final.usage.input_tokens == chat["prompt_tokens"], f"streamed {final.output_text!r} {final.usage}")
    check(c.responses.retrieve(final.id).model_dump() == final.model_dump(), "GET returns the stored response as streamed")
    # The token limit cuts a response: incomplete, whole and streamed.
    r = c.responses.create(model=m, input="Tell me a long story about a dragon.", max_output_tokens=3, temperature=0)
    check(r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3 and r.output[0].status == "incomplete", f"cut: {r}")
    cut = response_events_in_order(list(c.responses.create(model=m, input="Tell me a long story about a dragon.", max_output_tokens=3, temperature=0, stream=True)))
    check(cut.status == "incomplete" and cut.output_text == r.output_text, f"cut streamed: {cut}")
    # Instructions are the system message, before the input.
    instructions, question = "You are a calculator. Answer with a number only.", "What is 2 + 2?"
    r = c.responses.create(model=m, input=question, instructions=instructions, max_output_tokens=8, temperature=0)
    got, _, data = raw(url, "POST", "/tokenize", {"messages": [{"role": "system", "content": instructions}, {"role": "user", "content": question}]}, auth)
    check(got == 200 and json.loads(data)["count"] == r.usage.input_tokens and r.instructions == instructions, f"instructions: {r.usage.input_tokens} tokens vs {data[:100]!r}")
    # A function call round trip: the call, then its output with previous_response_id.
    q = "What is the weather in Paris right now?"
    r = c.responses.create(model=m, input=q, tools=[RESP_WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id and calls[0].id.startswith("fc_") and calls[0].status == "completed", f"one call: {r.output}")
    jsonschema.validate(json.loads(calls[0].arguments), RESP_WEATHER["parameters"])
    check(r.tools[0].name == "get_weather" and r.tool_choice == "required" and r.parallel_tool_calls is False, f"the request's tools echoed: {r.tools} {r.tool_choice}")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temperature": 18, "unit": "celsius", "sky": "clear"})}
    follow = dict(model=m, tools=[RESP_WEATHER], tool_choice="none", temperature=0, max_output_tokens=60)
    r2 = c.responses.create(previous_response_id=r.id, input=[result], **follow)
    check(r2.previous_response_id == r.id and r2.output_text and r2.output[0].type == "message", f"the answer after the call: {r2}")
    whole = [{"role": "user", "content": q}] + [o.model_dump(exclude_none=True) for o in r.output] + [result]
    r3 = c.responses.create(input=whole, **follow)
    check(r3.output_text == r2.output_text and r3.usage.input_tokens == r2.usage.input_tokens, f"previous_response_id is the whole conversation: {r3.output_text!r} vs {r2.output_text!r}")
    messages = [{"role": "user", "content": q},
                {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": result["output"]}]
    cr = c.chat.completions.create(model=m, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=60)
    check(cr.choices[0].message.content == r2.output_text and cr.usage.prompt_tokens == r2.usage.input_tokens, f"Chat Completions of the same conversation: {cr.choices[0].message.content!r} vs {r2.output_text!r}")
    # A named tool choice, streamed: exactly one call, its arguments in pieces.
    events = list(c.responses.create(model=m, input="What time is it in Tokyo, and the weather in Oslo?", tools=[RESP_WEATHER, RESP_TIME], tool_choice={"type": "function", "name": "get_time"}, temperature=0, stream=True))
    final = response_events_in_order(events)
    check([(o.type, o.name) for o in final.output] == [("function_call", "get_time")], f"named choice: {final.output}")
    jsonschema.validate(json.loads(final.output[0].arguments), RESP_TIME["parameters"])
    check(sum(e.type == "response.function_call_arguments.delta" for e in events) > 1, "the arguments streamed in pieces")
    # text.format: JSON under the schema (objects closed to their properties), and JSON objects.
    # Sampled ones are seeded (`seed`, maxrun's extension, as in Chat
    # Completions), so that a run is the same run each time.
    sampled = []
    for i, schema in enumerate(SCHEMAS[:8] + [NESTED]):
        for temperature in (0, 0.9):
            kwargs = dict(model=m, input="Reply with a JSON value that fits this schema: " + json.dumps(schema), temperature=temperature, max_output_tokens=400,
                          text={"format": {"type": "json_schema", "name": f"s{i}", "schema": schema, "strict": True}}, extra_body={"seed": i + 1})
            r = c.responses.create(**kwargs)
            check(r.status == "completed", f"schema {i} at {temperature}: {r.status} {r.output_text!r}")
            jsonschema.validate(json.loads(r.output_text), close_everywhere(schema), format_checker=jsonschema.FormatChecker())
            check(r.text.format.type == "json_schema" and r.text.format.name == f"s{i}", f"text echoed: {r.text}")
            if temperature and i < 3:
                again = c.responses.create(**kwargs).output_text
                other = c.responses.create(**{**kwargs, "extra_body": {"seed": 1000 + i}}).output_text
                check(again == r.output_text, f"schema {i}: seed {i + 1} twice gave {r.output_text!r} and {again!r}")
                sampled.append(r.output_text != other)
    check(any(sampled), "another seed never gave another reply")
    r = c.responses.create(model=m, input="Describe a cat as a JSON object.", temperature=0, max_output_tokens=200, text={"format": {"type": "json_object"}})
    check(isinstance(json.loads(r.output_text), dict), f"json_object: {r.output_text!r}")
    # Stored responses: GET, DELETE; store false keeps none; a missing one is a 404.
    kept = c.responses.create(model=m, input="Hi", max_output_tokens=4, temperature=0, metadata={"case": "kept"})
    check(c.responses.retrieve(kept.id).output_text == kept.output_text and kept.metadata == {"case": "kept"}, "GET a stored response")
    c.responses.delete(kept.id)
    unkept = c.responses.create(model=m, input="Hi", max_output_tokens=4, temperature=0, store=False)
    for gone in (kept.id, unkept.id, "resp_0123456789abcdef0123456789abcdef"):
        try:
            c.responses.retrieve(gone)
            raise AssertionError(f"GET {gone} found a response")
        except openai.NotFoundError:
            pass
        try:
            c.responses.create(model=m, input="And then?", previous_response_id=gone, max_output_tokens=4)
            raise AssertionError(f"previous_response_id {gone} was found")
        except openai.NotFoundError as e:
            err = e.response.json()["error"]
            check(set(err) == {"message", "type", "param", "code"} and err["param"] == "previous_response_id" and gone in err["message"], f"404 {err}")
    got, _, data = raw(url, "DELETE", f"/v1/responses/{kept.id}", None, auth)
    check(got == 404 and json.loads(data)["error"]["code"] == "response_not_found", f"a second DELETE: {got} {data[:200]!r}")
    # Unsupported parts: 400 naming the field.
    q1 = [{"role": "user", "content": "hi"}]
    for body, param in (
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content[0].type"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "hi", "top_logprobs": 5}, "top_logprobs"),
        ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "tools": [RESP_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}}}, "text.format"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": q1 + [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[1].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": 7}, "input"),
        ({}, "input"),
        ({"input": "hi", "model": "gpt-5"}, "model"),
    ):
        got, _, data = raw(url, "POST", "/v1/responses", body, auth)
        err = json.loads(data).get("error", {})
        want = 404 if param == "model" else 400
        check(got == want and set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, f"{body}: {got} {err}")
    got, _, data = raw(url, "GET", f"/v1/responses/{r.id}?stream=true", None, auth)
    check(got == 400 and json.loads(data)["error"]["param"] == "stream", f"GET with stream: {got}")
    if exp.get("api_key"):
        check(raw(url, "POST", "/v1/responses", {"input": "hi"})[0] == 401 and raw(url, "GET", f"/v1/responses/{r.id}")[0] == 401, "the API key guards /v1/responses")


def scenario_responses_store(url, exp):
    """The store keeps the last --response-store-entries responses, least
    recently used out first: reading one keeps it. With
    --allow-extra-request-fields unknown fields (and unknown keys in items) are
    dropped, and the fields maxrun knows it cannot honour are still refused."""
    c = client(url, exp.get("api_key"))
    got, _, data = raw(url, "POST", "/v1/responses", {"input": [{"role": "user", "content": "Hi", "vendor_tag": 1}], "max_output_tokens": 2, "vendor_option": True})
    check(got == 200 and json.loads(data)["object"] == "response", f"extra fields dropped: {got} {data[:200]!r}")
    for body, param in (({"input": "Hi", "conversation": "conv_1"}, "conversation"), ({"input": "Hi", "background": True}, "background"), ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type")):
        got, _, data = raw(url, "POST", "/v1/responses", body)
        check(got == 400 and json.loads(data)["error"]["param"] == param, f"{body} with extra fields allowed: {got} {data[:200]!r}")
    new = lambda: c.responses.create(model=exp["model"], input="Hi", max_output_tokens=2, temperature=0).id

    def stored(rid):
        try:
            c.responses.retrieve(rid)
            return True
        except openai.NotFoundError:
            return False

    a, b, d = new(), new(), new()
    check([stored(x) for x in (b, d)] == [True, True] and not stored(a), f"two kept of three, the first gone: {[stored(x) for x in (a, b, d)]}")
    check(stored(b), "b read again")
    e = new()
    check(stored(b) and stored(e) and not stored(d), "d, used less recently than b, went")


def scenario_agents(url, exp):
    """The OpenAI Agents SDK (its tracing off: it sends nothing but the model's
    requests, all to this server) runs a one-tool agent loop with its Responses
    model, whole and streamed, and with its Chat Completions model: the tool is
    called once with the city, and its result (a temperature the model cannot
    know otherwise) reaches the final answer; the three give the same answer
    (greedy decoding of one prompt: both APIs render the conversation alike)."""
    import asyncio
    import os
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key=exp.get("api_key") or "none", max_retries=0, timeout=120)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"The weather in {city} is sunny and 23 degrees."

    async def run(model, streamed):
        calls.clear()
        # The first turn must call the tool (the SDK sets tool_choice back to
        # auto after it, so the loop ends with an answer).
        agent = Agent(name="Weather", instructions="You answer questions about the weather in one short sentence, using the tool's result.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80))
        if streamed:
            result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            kinds = set()
            async for event in result.stream_events():
                kinds.add(event.type)
            check("raw_response_event" in kinds, f"streamed events {kinds}")
        else:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        check(calls == ["Paris"], f"{type(model).__name__}: tool calls {calls}")
        check(isinstance(result.final_output, str) and "23" in result.final_output, f"{type(model).__name__}: the tool's result is not in the answer {result.final_output!r}")
        return result.final_output

    async def main():
        answers = [await run(OpenAIResponsesModel(model=exp["model"], openai_client=api), False),
                   await run(OpenAIResponsesModel(model=exp["model"], openai_client=api), True),
                   await run(OpenAIChatCompletionsModel(model=exp["model"], openai_client=api), False)]
        check(len(set(answers)) == 1, f"the answers differ: {answers}")
        print("agents:", answers[0])

    asyncio.run(main())


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def wait_idle(url, seconds=60):
    """Waits until no sequence runs and no KV block is held; returns the metrics."""
    deadline = time.time() + seconds
    while True:
        m = metrics(url)
        if m["maxrun_running_sequences"] == 0 and m["maxrun_kv_blocks_used"] == 0 and m["maxrun_queue_depth"] == 0:
            return m
        check(time.time() < deadline, f"not idle {seconds} s after the load: {m}")
        time.sleep(0.1)


def scenario_soak(url, exp):
    """Continuous random load for exp["seconds"] (issue #34): greedy requests
    (whole and streamed) whose texts must equal the command line's single-stream
    texts, sampled requests with random parameters and prompt lengths, clients
    that leave mid-stream, prompts past the context (400) and a KV pool small
    enough to run out (preemption), a queue short enough to fill (503). The only
    errors allowed are those two documented ones; afterwards the KV blocks go back
    to none used and resident memory to about its level after the warm-up."""
    import random

    # A request may wait behind long prompts and preemptions on 2 busy cores:
    # the client waits longer than elsewhere, and the slowest is printed.
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    greedy = exp["concurrent"]
    words = ("river stone light winter garden music number paper window bridge morning "
             "letter forest engine silver market story ocean mountain question").split()
    # Warm-up: every greedy case once, alone, and a long prompt (allocator pools
    # and the engine's buffers reach their working size).
    for g in greedy:
        r = c.completions.create(model=exp["model"], prompt=g["prompt"], max_tokens=g["max_tokens"], temperature=0)
        check(r.choices[0].text == g["text"], f"warm-up greedy text for {g['prompt']!r}: {r.choices[0].text!r} != {g['text']!r}")
    c.completions.create(model=exp["model"], prompt=" ".join(words * 60), max_tokens=8, temperature=0.8, seed=1)
    wait_idle(url)
    idle_rss = rss_kib(exp["pid"])
    m0 = metrics(url)
    counts = {}
    failures = []
    lock = threading.Lock()
    deadline = time.time() + exp["seconds"]

    def note(kind):
        with lock:
            counts[kind] = counts.get(kind, 0) + 1

    def one(r):
        kind = r.choice(["greedy", "greedy_stream", "sampled", "sampled", "sampled_stream", "cancel", "long", "too_long"])
        if kind in ("greedy", "greedy_stream"):
            g = r.choice(greedy)
            if kind == "greedy":
                got = c.completions.create(model=exp["model"], prompt=g["prompt"], max_tokens=g["max_tokens"], temperature=0).choices[0].text
            else:
                got = "".join(ch.choices[0].text for ch in c.completions.create(
                    model=exp["model"], prompt=g["prompt"], max_tokens=g["max_tokens"], temperature=0, stream=True) if ch.choices)
            check(got == g["text"], f"{kind} text under load for {g['prompt']!r}: {got!r} != {g['text']!r}")
        elif kind in ("sampled", "sampled_stream", "long"):
            n_words = r.randint(exp["max_length"] // 3, exp["max_length"] * 2 // 3) if kind == "long" else r.randint(1, 300)
            prompt = " ".join(r.choice(words) for _ in range(n_words))
            max_tokens = r.randint(64, 256) if kind == "long" else r.randint(1, 64)
            params = dict(model=exp["model"], prompt=prompt, max_tokens=max_tokens, temperature=r.uniform(0.2, 1.5),
                          top_p=r.uniform(0.5, 1.0), seed=r.randrange(1 << 30),
                          extra_body={"top_k": r.choice([0, 5, 40]), "min_p": r.choice([0.0, 0.05])})
            if kind == "sampled_stream":
                text, finish = "", None
                for ch in c.completions.create(stream=True, **params):
                    if ch.choices:
                        text += ch.choices[0].text
                        finish = ch.choices[0].finish_reason or finish
                check(finish in ("stop", "length"), f"finish_reason {finish}")
            else:
                resp = c.completions.create(**params)
                check(resp.choices[0].finish_reason in ("stop", "length"), f"finish_reason {resp.choices[0].finish_reason}")
                check(resp.usage.completion_tokens <= max_tokens, f"usage {resp.usage}")
        elif kind == "cancel":
            stream = c.completions.create(model=exp["model"], prompt=" ".join(r.choice(words) for _ in range(r.randint(5, 200))),
                                          max_tokens=400, temperature=0.7, stream=True)
            leave_after = r.randint(1, 20)
            for i, _ in enumerate(stream):
                if i >= leave_after:
                    break
            stream.close()
        else:  # too_long: past the context, refused with the documented 400
            try:
                c.completions.create(model=exp["model"], prompt=" ".join(words * (exp["max_length"] // 15)), max_tokens=4)
                raise AssertionError("a prompt past the context was accepted")
            except openai.BadRequestError as e:
                check("context" in str(e), f"400 for a long prompt: {e}")
        note(kind)

    slowest = [0.0]

    def worker(w):
        r = random.Random(1000 + w)
        while time.time() < deadline:
            try:
                start = time.time()
                one(r)
                with lock:
                    slowest[0] = max(slowest[0], time.time() - start)
            except openai.APIStatusError as e:
                if e.status_code == 503:  # a full queue: documented, back off as told
                    note("503")
                    time.sleep(float(e.response.headers.get("retry-after", "1")) * 0.1)
                else:
                    with lock:
                        failures.append(f"{e.status_code}: {e}")
            except Exception as e:  # noqa: BLE001 -- every other error is a failure
                with lock:
                    failures.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(exp["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=exp["seconds"] + 300)
        check(not t.is_alive(), "a client is still running long after the deadline")
    check(not failures, f"{len(failures)} failures, first: {failures[:3]}")
    m = wait_idle(url)
    done = sum(v for k, v in counts.items() if k != "503")
    check(done >= 10, f"too few requests completed: {counts}")
    check(m["maxrun_preemptions"] > m0.get("maxrun_preemptions", 0), f"the KV pool never ran out: {counts}")
    time.sleep(1.0)
    after_rss = rss_kib(exp["pid"])
    # Within 10% + 32 MiB of the level after the warm-up (allocator caches).
    check(after_rss <= idle_rss * 1.10 + 32 * 1024, f"resident memory {idle_rss} KiB -> {after_rss} KiB after the load")
    print(f"soak: {exp['seconds']} s, {counts}, slowest request {slowest[0]:.1f} s, resident {idle_rss} -> {after_rss} KiB")


if __name__ == "__main__":
    name, url, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(expected) as f:
        exp = json.load(f)
    globals()["scenario_" + name](url, exp)
    print(f"{name}: ok")
