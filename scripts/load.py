#!/usr/bin/env python3
"""Load benchmark for OpenAI-compatible servers (maxrun serve, llama-server).

Drives POST /v1/completions with `stream: true` from N concurrent clients on
loopback, each sending requests one after another, bounded by a request count
and a time limit, and reports requests/s, output tokens/s, and p50/p99 time to
first token and inter-token latency. Standard library only.

    scripts/load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 32 \
        --prompt-tokens 32 --max-tokens 64 [--json out.json]

Prompts are made of distinct words per request (no shared prefix between
requests unless --shared-prefix N words are asked for, and none with an earlier
run unless --salt repeats it), and every request asks
for exactly --max-tokens tokens (`ignore_eos`, which both servers accept).
With --prompts-file FILE (JSON lines of {"prompt": ...}, such as
../shared/speculation/prompts.jsonl) the requests are chat completions of
those prompts in turn, greedy, up to --max-tokens tokens each (replies end
where the model ends them): real text, as speculative decoding needs.
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("time river stone light garden market winter letter music window forest "
         "number paper summer engine bridge story mountain silver ocean").split()


def prompt(index, words, shared, salt):
    head = " ".join(WORDS[i % len(WORDS)] for i in range(shared))
    own = " ".join(WORDS[(index * 7 + i * 3 + salt) % len(WORDS)] + str((index * 31 + i + salt) % 997) for i in range(words))
    return (head + " " + own).strip()


def one_request(url, body, timeout, path="/v1/completions"):
    """Sends one streaming completion; returns (ttft, gaps, tokens, ok)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    start = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        conn.close()
        return None, [], 0, False
    ttft, last, gaps, tokens = None, None, [], 0
    usage = None
    buf = b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"]
                choices = msg.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    tokens += 1
    conn.close()
    if usage and usage.get("completion_tokens"):
        tokens = usage["completion_tokens"]
    return ttft, gaps, tokens, ttft is not None


def percentile(xs, p):
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="base URL, loopback only (http://127.0.0.1:PORT)")
    ap.add_argument("--model", help="the model name to send (none by default: the server's own)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16, help="requests in all")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds; no new request starts after it")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="about this many prompt tokens (words)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="words every prompt starts with")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--salt", type=int, default=None, help="varies the prompts (default: from the clock, so that a server's prefix cache holds nothing of an earlier run)")
    ap.add_argument("--prompts-file", help="JSON lines of {\"prompt\": ...}: chat completions of these prompts in turn instead of made-up words")
    ap.add_argument("--json-schema", help="a JSON schema file: every request asks for output that fits it (response_format)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    host = urllib.parse.urlparse(args.url).hostname
    if not (host == "localhost" or host == "::1" or host.startswith("127.")):
        sys.exit(f"load.py drives loopback servers only, not {host}")

    salt = args.salt if args.salt is not None else int(time.time() * 1000) % 100_000
    chats = None
    if args.prompts_file:
        with open(args.prompts_file) as f:
            chats = [json.loads(l)["prompt"] for l in f if l.strip()]
    schema = None
    if args.json_schema:
        with open(args.json_schema) as f:
            schema = json.load(f)
    lock = threading.Lock()
    next_index = [0]
    results = []
    deadline = time.perf_counter() + args.time_limit

    def client():
        while True:
            with lock:
                i = next_index[0]
                if i >= args.requests or time.perf_counter() > deadline:
                    return
                next_index[0] += 1
            path = "/v1/completions"
            if chats is not None:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": chats[i % len(chats)]}], "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            else:
                body = {
                    "prompt": prompt(i, args.prompt_tokens, args.shared_prefix, salt),
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                }
            if args.model:
                body["model"] = args.model
            if schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "load", "schema": schema}}
            r = one_request(args.url, body, timeout=max(60.0, args.time_limit), path=path)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r[3]]
    ttfts = [r[0] for r in ok]
    gaps = [g for r in ok for g in r[1]]
    tokens = sum(r[2] for r in ok)
    out = {
        "url": args.url,
        "concurrency": args.concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "prompt_words": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seconds": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_ms_p50": 1e3 * percentile(ttfts, 50),
        "ttft_ms_p99": 1e3 * percentile(ttfts, 99),
        "itl_ms_p50": 1e3 * percentile(gaps, 50),
        "itl_ms_p99": 1e3 * percentile(gaps, 99),
        "itl_ms_mean": 1e3 * (statistics.fmean(gaps) if gaps else 0.0),
    }
    print(f"concurrency {args.concurrency}: {out['requests']} requests ({out['failed']} failed) in {wall:.1f} s; "
          f"{out['requests_per_s']:.2f} req/s, {out['output_tokens_per_s']:.1f} output tok/s; "
          f"TTFT p50 {out['ttft_ms_p50']:.0f} ms p99 {out['ttft_ms_p99']:.0f} ms; "
          f"ITL p50 {out['itl_ms_p50']:.1f} ms p99 {out['itl_ms_p99']:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(1 if out["failed"] else 0)


if __name__ == "__main__":
    main()
