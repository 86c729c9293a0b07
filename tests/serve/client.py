#!/usr/bin/env python3
"""Clients of `maxrun serve` for tests/tests/serve.rs: the official `openai`
package, raw HTTP (http.client and sockets) and prometheus_client's parser of
the text format. Each scenario exits 0 or raises with what went wrong.

    client.py SCENARIO URL EXPECTED.json

EXPECTED.json holds what the scenario needs: the texts `maxrun --prompt` and
`maxrun --chat` printed for the same requests, an API key, golden embeddings.
"""

import http.client
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
    before = metrics(url).get("maxrun_cancelled_requests_total", 0)
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
    check(m["maxrun_generated_tokens_total"] < before + 1500, "stopped generating")


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
        ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None),
        ("POST", "/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ("POST", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ("POST", "/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs", None),
        ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", None),
        ("POST", "/v1/completions", {"prompt": [exp["vocab"] + 5]}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
        ("POST", "/v1/completions", {"prompt": long_prompt}, 400, "prompt", "context_length_exceeded"),
        ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools", None),
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
    check(raw(url, "GET", "/health")[0] == 200, "health")
    m = metrics(url)
    check(m.get("maxrun_requests_total{endpoint=/v1/completions,status=400}", 0) >= 14, f"400s counted: {m}")


def scenario_queue(url, exp):
    """Past --max-queue waiting requests, new ones get 503 with Retry-After."""
    statuses, retry = [], []

    def run(i):
        got, headers, data = raw(url, "POST", "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
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


if __name__ == "__main__":
    name, url, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(expected) as f:
        exp = json.load(f)
    globals()["scenario_" + name](url, exp)
    print(f"{name}: ok")
