//! `maxrun serve` tested for real: the server is started on a free loopback
//! port and driven by real clients (tests/serve/client.py: the official `openai`
//! package, raw HTTP, prometheus_client's text parser, jsonschema as the judge of
//! structured output). What the clients must
//! get back comes from `maxrun --prompt` and `--chat` on the same artifact, and
//! from the goldens. Every server is stopped with SIGTERM and must exit 0.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use maxc_tests::*;
use serde_json::{json, Value};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// SmolLM2 as the README compiles it (Q4_1 blocks), once per test binary.
fn smollm2() -> &'static Path {
    static A: OnceLock<TempPath> = OnceLock::new();
    A.get_or_init(|| compile_model("serve-smollm2", &smollm2_gguf(), &[]))
}

/// The GGUF's `general.name`, which the artifact compiled from it without a
/// manifest keeps as its model name.
const SMOLLM2_GGUF_NAME: &str = "Smollm2 135M 8k Lc100K Mix1 Ep2";
/// The id that name is served as (docs/serving.md, `--served-model-name`:
/// lowercased, each run of other characters one `-`).
const SMOLLM2_SERVED: &str = "smollm2-135m-8k-lc100k-mix1-ep2";

/// A running `maxrun serve`.
struct Server {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(mef: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(bin("maxrun"))
            .args([os("serve"), mef.as_os_str(), os("--host"), os("127.0.0.1"), os("--port"), os("0")])
            // Two threads unless the test says otherwise.
            .args(if extra.contains(&"--threads") { &[][..] } else { &["--threads", "2"][..] })
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("maxrun starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("on http://") {
                    let url: String = line[at + 3..].split_whitespace().next().unwrap().to_string();
                    let _ = tx.send(url);
                }
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let url = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("the server did not start: {}", log.lock().unwrap())
        });
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        Server { child, url, log }
    }

    /// Sends SIGTERM and waits (at most `within`) for the exit; returns the code.
    fn stop(&mut self, within: Duration) -> i32 {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            if start.elapsed() > within {
                let _ = self.child.kill();
                panic!("the server did not stop within {within:?} of SIGTERM: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs one scenario of tests/serve/client.py against `url` with `expected`.
fn client(scenario: &str, url: &str, expected: &Value) -> std::process::Child {
    client_within(scenario, url, expected, 600)
}

/// As [`client`], killed after `seconds`.
fn client_within(scenario: &str, url: &str, expected: &Value, seconds: u64) -> std::process::Child {
    // Read by the client after this returns: kept (a few bytes) to the run's end.
    let dir = temp_dir(&format!("serve-{scenario}")).keep();
    let file = dir.join("expected.json");
    std::fs::write(&file, expected.to_string()).unwrap();
    Command::new("timeout")
        .args([os(&seconds.to_string()), os("python3"), workspace_root().join("tests/serve/client.py").as_os_str(), os(scenario), os(url), file.as_os_str()])
        .env("PYTHONPATH", workspace_root().join(".cache/python"))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 starts")
}

fn run_client(scenario: &str, server: &Server, expected: &Value) {
    let out = client(scenario, &server.url, expected).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "client scenario {scenario} failed:\n{}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
}

/// What `maxrun --prompt P -n N --temperature 0` prints: (text, generated tokens).
fn cli_prompt(mef: &Path, prompt: &str, n: usize) -> (String, usize) {
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os(prompt), os("-n"), os(&n.to_string()), os("--temperature"), os("0")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let generated = r.2.split("generated: ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).expect("the stats line");
    (r.1, generated)
}

/// What `maxrun --chat --temperature 0 -n N` answers to one user message:
/// (text, prompt tokens, generated tokens).
fn cli_chat(mef: &Path, message: &str, n: usize) -> (String, usize, usize) {
    let mut child = Command::new(bin("maxrun"))
        .args([mef.as_os_str(), os("--chat"), os("--temperature"), os("0"), os("-n"), os(&n.to_string())])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{message}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let turn = stderr.lines().find(|l| l.starts_with("turn 1:")).expect("turn stats");
    let prompt: usize = turn.split_whitespace().nth(2).unwrap().parse().unwrap();
    let generated: usize = turn.split(", ").last().unwrap().split(' ').next().unwrap().parse().unwrap();
    (String::from_utf8_lossy(&out.stdout).trim_end_matches('\n').to_string(), prompt, generated)
}

const PROMPTS: [&str; 16] = [
    "Once upon a time, there was a little robot",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, astronauts",
    "A recipe for pancakes: first,",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "My favourite book is",
    "Water boils at",
    "List three animals that live in the ocean:",
    "The meaning of life is",
    "To be or not to be,",
    "Rust is a programming language that",
    "The best way to learn a language is",
];

#[test]
fn openai_clients_get_what_the_command_line_prints() {
    let mef = smollm2();
    let model = SMOLLM2_SERVED.to_string();
    let golden = golden("smollm2-135m");
    let completions: Vec<Value> = cases(&golden)
        .iter()
        .map(|c| {
            let prompt = c["prompt"].as_str().unwrap();
            let (text, generated) = cli_prompt(mef, prompt, 24);
            let finish = if generated < 24 { "stop" } else { "length" };
            json!({"prompt": prompt, "prompt_ids": c["input_ids"], "prompt_tokens": ids(&c["input_ids"]).len(), "max_tokens": 24, "text": text, "completion_tokens": generated, "finish_reason": finish})
        })
        .collect();
    let chat_case = &golden["chat"];
    let messages = &chat_case["messages"];
    let (text, prompt_tokens, generated) = cli_chat(mef, messages[0]["content"].as_str().unwrap(), 48);
    assert_eq!(text, chat_case["greedy_text"].as_str().unwrap().trim_end_matches("<|im_end|>"), "the command line answers the golden chat case");
    let chats = vec![json!({"messages": messages, "max_tokens": 48, "text": text, "prompt_tokens": prompt_tokens, "finish_reason": if generated < 48 { "stop" } else { "length" }})];
    let concurrent: Vec<Value> = PROMPTS.iter().map(|p| json!({"prompt": p, "max_tokens": 24, "text": cli_prompt(mef, p, 24).0})).collect();
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    let expected = json!({
        "model": model,
        "api_key": "sk-test-key",
        "completions": completions,
        "chats": chats,
        "concurrent": concurrent,
        "max_length": a.header.max_length,
        "vocab": a.header.model.vocab_size,
    });
    let mut server = Server::start(mef, &["--api-key", "sk-test-key"]);
    run_client("golden", &server, &expected);
    run_client("concurrent", &server, &expected);
    run_client("bad_requests", &server, &expected);
    run_client("choices", &server, &expected);
    run_client("structured", &server, &expected);
    run_client("tools", &server, &expected);
    // The disconnect scenario reads /metrics, which needs no key.
    run_client("disconnect", &server, &expected);
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
    // One log line per request, as JSON.
    let log = server.log();
    let lines: Vec<Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(lines.iter().any(|l| l["status"] == 200 && l["endpoint"] == "/v1/chat/completions" && l["completion_tokens"].as_u64().is_some()), "{log}");
    assert!(lines.iter().any(|l| l["status"] == 400), "{log}");
}

/// Issue #65: a server started with `--speculative ngram` answers eight
/// concurrent clients (whole and streamed) with the text `maxrun --chat`
/// prints without speculation for input-grounded prompts of
/// `../shared/speculation/prompts.jsonl`, and counts its drafts on /metrics.
#[test]
fn a_speculative_server_answers_what_plain_decoding_does() {
    let mef = smollm2();
    let prompts = std::fs::read_to_string(fixtures_dir().parent().unwrap().join("speculation/prompts.jsonl")).unwrap();
    let chats: Vec<Value> = prompts
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "input-grounded")
        .step_by(6)
        .map(|v| {
            // `--chat` reads a message a line, its trailing whitespace trimmed.
            let message = v["prompt"].as_str().unwrap().replace('\n', " ").trim().to_string();
            json!({"message": message, "max_tokens": 40, "text": cli_chat(mef, &message, 40).0})
        })
        .collect();
    assert_eq!(chats.len(), 4);
    let expected = json!({"model": SMOLLM2_SERVED, "chats": chats});
    let mut server = Server::start(mef, &["--speculative", "ngram"]);
    run_client("speculative", &server, &expected);
    assert!(server.log().contains("speculative: n-gram"), "{}", server.log());
    assert_eq!(server.stop(Duration::from_secs(30)), 0);
}

/// Issue #66, OpenAI's strict semantics and vLLM's /tokenize: objects whose
/// schema omits `additionalProperties` take only their declared properties
/// (20 seeds at temperature 0.9, judged by jsonschema against the schema
/// closed everywhere); a named tool choice makes exactly one call, whole and
/// streamed, `parallel_tool_calls: false` at most one; /tokenize gives the ids
/// of the `tokenizers` crate over SmolLM2's own tokenizer.json (and
/// transformers' golden ids, its chat template's included), /detokenize gives
/// the text back; bad requests are 400s naming the field.
#[test]
fn strict_schemas_named_tool_calls_and_tokenize() {
    let mef = smollm2();
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    // SmolLM2's tokenizer.json as Hugging Face ships it: the oracle, not the
    // artifact's tokenizer (which the compiler rebuilt from the GGUF).
    let hf = tokenizers::Tokenizer::from_file(fixture("tiny-llama").join("tokenizer.json")).unwrap();
    let golden = golden("smollm2-135m");
    let mut texts: Vec<String> = cases(&golden).iter().map(|c| c["prompt"].as_str().unwrap().to_string()).collect();
    texts.extend(PROMPTS.iter().map(|p| p.to_string()));
    texts.extend(
        ["  two leading spaces", "tabs\tand\nnewlines\n\n", "Ünïcödé — ça va? 日本語 🎉 ok", "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159 x=y+z;", "a"]
            .map(String::from),
    );
    let encode = |t: &str, special: bool| hf.encode(t, special).unwrap().get_ids().to_vec();
    let text_cases: Vec<Value> = texts
        .iter()
        .map(|t| {
            let ids = encode(t, true);
            let strs: Vec<String> = ids.iter().map(|&i| hf.id_to_token(i).unwrap()).collect();
            json!({"text": t, "ids": ids, "ids_plain": encode(t, false), "token_strs": strs, "decoded": hf.decode(&ids, false).unwrap()})
        })
        .collect();
    let golden_cases: Vec<Value> = cases(&golden).iter().map(|c| json!({"prompt": c["prompt"], "input_ids": c["input_ids"]})).collect();
    let chat = &golden["chat"];
    let chat_ids = ids(&chat["input_ids"]);
    let generation_prompt = encode("<|im_start|>assistant\n", false);
    assert!(chat_ids.ends_with(&generation_prompt), "the golden chat prompt ends with the generation prompt");
    let expected = json!({
        "model": SMOLLM2_SERVED,
        "api_key": "sk-66",
        "vocab": a.header.model.vocab_size,
        "max_length": a.header.max_length,
        "texts": text_cases,
        "golden": golden_cases,
        "chat": {
            "messages": chat["messages"],
            "input_ids": chat_ids,
            "without_generation_prompt": chat_ids[..chat_ids.len() - generation_prompt.len()],
            "decoded": hf.decode(&chat_ids, false).unwrap(),
        },
    });
    let mut server = Server::start(mef, &["--api-key", "sk-66"]);
    run_client("tokenize", &server, &expected);
    run_client("strict", &server, &expected);
    run_client("tool_choice", &server, &expected);
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
}

/// Issue #66, the Responses API: `client.responses.create` answers the golden
/// chat case with `maxrun --chat`'s text and prompt tokens, whole and streamed
/// (the events in OpenAI's order), and the scenario checks cut responses,
/// instructions, a function-call round trip through `previous_response_id`
/// (against the whole conversation sent again, and against Chat Completions),
/// a named tool choice, `text.format` (jsonschema the judge), GET / DELETE and
/// 404s, and 400s naming unsupported fields; the store keeps its newest
/// responses by use (`--response-store-entries 2`), and
/// `--allow-extra-request-fields` drops only unknown fields; and the OpenAI Agents SDK
/// runs a one-tool agent loop with its Responses model (whole and streamed)
/// and its Chat Completions model.
#[test]
fn the_responses_api_and_the_agents_sdk() {
    let mef = smollm2();
    let model = SMOLLM2_SERVED.to_string();
    let golden = golden("smollm2-135m");
    let messages = &golden["chat"]["messages"];
    let (text, prompt_tokens, generated) = cli_chat(mef, messages[0]["content"].as_str().unwrap(), 48);
    let chat = json!({"messages": messages, "max_tokens": 48, "text": text, "prompt_tokens": prompt_tokens, "finish_reason": if generated < 48 { "stop" } else { "length" }});
    let expected = json!({"model": model, "api_key": "sk-resp", "chat": chat});
    let mut server = Server::start(mef, &["--api-key", "sk-resp"]);
    run_client("responses", &server, &expected);
    run_client("agents", &server, &expected);
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
    let log = server.log();
    let lines: Vec<Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(lines.iter().any(|l| l["endpoint"] == "/v1/responses" && l["status"] == 200 && l["finish_reason"] == "completed"), "{log}");
    let mut server = Server::start(mef, &["--response-store-entries", "2", "--allow-extra-request-fields"]);
    run_client("responses_store", &server, &json!({"model": model}));
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
}

/// `--reasoning-parser think`: a reply's `<think>...</think>` comes back as
/// `reasoning_content` (the reply is held to that shape by a Lark grammar).
#[test]
fn a_reasoning_parser_splits_the_thinking_from_the_answer() {
    let mef = smollm2();
    let model = SMOLLM2_SERVED.to_string();
    let mut server = Server::start(mef, &["--reasoning-parser", "think"]);
    run_client("reasoning", &server, &json!({"model": model}));
    assert_eq!(server.stop(Duration::from_secs(60)), 0);
}

/// gpt-oss's harmony format (issue #64): arch-gpt-oss with a chat template in
/// the harmony layout (gpt-oss's own markers: `<|start|>ROLE<|message|>`,
/// calls written back as `<|start|>assistant to=functions.NAME ...<|call|>`),
/// served with default flags, so the template's `<|channel|>` picks the
/// harmony tool parser and the reasoning split (tests/serve/client.py,
/// scenario_harmony).
#[test]
fn harmony_replies_give_reasoning_content_and_tool_calls() {
    let template = concat!(
        "{%- for m in messages -%}",
        "{%- if m.role == 'assistant' and m.tool_calls -%}",
        "{%- for c in m.tool_calls -%}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>{{ c.function.arguments }}<|call|>{%- endfor -%}",
        "{%- elif m.role == 'tool' -%}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>",
        "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if tools -%}<|start|>developer<|message|># Tools{%- for t in tools %} {{ t.function.name }}{%- endfor -%}<|end|>{%- endif -%}",
        "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}",
    );
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(fixture("arch-gpt-oss").join("tokenizer_config.json")).unwrap()).unwrap();
    config["chat_template"] = json!(template);
    let dir = fixture_with("arch-gpt-oss", "harmony", &[("tokenizer_config.json", config.to_string())]);
    let mef = compile_model("harmony", dir.as_path(), &["--max-length", "512"]);
    let mut server = Server::start(&mef, &["--served-model-name", "gpt-oss-fixture"]);
    run_client("harmony", &server, &json!({"model": "gpt-oss-fixture"}));
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
}

/// Issue #67: the fields sglang-router and vLLM / SGLang clients add are
/// taken by a server with default flags, and honoured (tests/serve/client.py,
/// scenario_router_fields: kept stop strings against the command line's reply,
/// skipped special tokens against the tokenizer's text of `<|im_start|>`, a
/// continued final message against a completion of the cut template
/// rendering); the artifact compiled from the GGUF alone serves its
/// `general.name` as an id without spaces; SGLang's info endpoints and vLLM's
/// gauges agree with the server's own numbers.
#[test]
fn the_fields_routers_add_are_honoured() {
    let mef = smollm2();
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    assert_eq!(a.header.model.name, SMOLLM2_GGUF_NAME, "the GGUF's general.name, which the served id is made from");
    let prompt = PROMPTS[0];
    let greedy = json!({"prompt": prompt, "text": cli_prompt(mef, prompt, 24).0});
    let hf = tokenizers::Tokenizer::from_file(fixture("tiny-llama").join("tokenizer.json")).unwrap();
    let special = hf.token_to_id("<|im_start|>").unwrap();
    let expected = json!({
        "model": SMOLLM2_SERVED,
        "greedy": greedy,
        "special_token": {"id": special, "text": "<|im_start|>"},
        "max_length": a.header.max_length,
        "block_size": a.header.batch.unwrap().block_size,
    });
    let mut server = Server::start(mef, &[]);
    run_client("router_fields", &server, &expected);
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let mef = smollm2();
    let mut server = Server::start(mef, &["--max-queue", "1"]);
    run_client("queue", &server, &json!({"requests": 22}));
    assert_eq!(server.stop(Duration::from_secs(60)), 0);
}

#[test]
fn sigterm_during_a_stream_ends_it_and_exits_cleanly() {
    let mef = smollm2();
    let mut server = Server::start(mef, &["--shutdown-timeout", "1"]);
    let model = SMOLLM2_SERVED.to_string();
    let streaming = client("stream_until_signal", &server.url, &json!({"model": model}));
    // Wait until the stream runs (its request holds KV blocks), then stop the server.
    let start = Instant::now();
    loop {
        if metric(&server.url, "maxrun_running_sequences") == 1.0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the stream never started: {}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let stopped = Instant::now();
    assert_eq!(server.stop(Duration::from_secs(30)), 0, "{}", server.log());
    assert!(stopped.elapsed() < Duration::from_secs(10), "stopped in {:?}", stopped.elapsed());
    let out = streaming.wait_with_output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // New connections are refused once it has stopped.
    let r = Command::new("curl").args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &format!("{}/health", server.url)]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "000");
}

#[test]
fn embeddings_of_a_sentence_encoder_match_the_golden() {
    let mef = compile_model("serve-minilm", &minilm_dir(), &[]);
    let golden = golden("all-minilm-l6-v2");
    let (shape, data) = maxrun_runtime::npy::read_f32(&fixture("all-minilm-l6-v2").join("embeddings.npy")).unwrap();
    let embeddings: Vec<Vec<f32>> = data.chunks(shape[1]).map(<[f32]>::to_vec).collect();
    let model = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header.model.name.clone();
    let expected = json!({"model": model, "sentences": golden["sentences"], "embeddings": embeddings});
    let mut server = Server::start(&mef, &[]);
    run_client("embeddings", &server, &expected);
    assert_eq!(server.stop(Duration::from_secs(30)), 0);
}

/// `/v1/embeddings` with 64 inputs (the golden sentences, each repeated 1 to 4
/// times) through the openai client, from an encoder compiled for 16 inputs
/// per step: 64 embeddings in order, each within cosine 0.9999 of the same
/// input embedded alone by the single-sequence plan (here, in-process), in
/// exactly ceil(64 / 16) = 4 model steps by the server's
/// `maxrun_embedding_steps_total` (one at a time would take 64, everything in
/// one step 1).
#[test]
fn many_embeddings_run_in_batched_steps() {
    let mef = compile_model("serve-minilm-batch", &minilm_dir(), &["--max-sequences", "16"]);
    let golden = golden("all-minilm-l6-v2");
    let sentences: Vec<&str> = golden["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let texts: Vec<String> = (0..64).map(|k| vec![sentences[k % 8]; k / 8 % 4 + 1].join(" ")).collect();
    let mut tokenizer = tokenizers::Tokenizer::from_file(minilm_dir().join("tokenizer.json")).unwrap();
    tokenizer.with_padding(None);
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| tokenizer.encode(t.as_str(), true).unwrap().get_ids().to_vec()).collect();
    let a = maxrun_runtime::artifact::Artifact::open(&mef).unwrap();
    assert_eq!(a.header.main().encode_batch.as_ref().map(|e| e.max_sequences), Some(16));
    let mut session = maxrun_runtime::session::Session::new(&a, 2).unwrap();
    let alone: Vec<Vec<f32>> = ids
        .iter()
        .map(|ids| {
            session.reset();
            session.forward(ids).unwrap().to_vec()
        })
        .collect();
    let tokens: usize = ids.iter().map(Vec::len).sum();
    let expected = json!({"model": a.header.model.name, "inputs": texts, "alone": alone, "steps": 4, "tokens": tokens});
    let mut server = Server::start(&mef, &[]);
    run_client("embeddings_batched", &server, &expected);
    assert!(server.log().contains("batched embeddings: 16 inputs"), "{}", server.log());
    assert_eq!(server.stop(Duration::from_secs(30)), 0);
}

/// The soak test (issue #34): random load on a server with a KV pool small
/// enough to run out and a short queue, for `MAXC_SOAK_SECONDS` (60 in the
/// suite; the long form: `MAXC_SOAK_SECONDS=600 cargo test -p maxc-tests --test
/// serve soak`). Greedy outputs must equal the command line's single-stream
/// texts, the only errors are the documented 400 and 503, and afterwards no KV
/// block is held and resident memory is back near its level after the warm-up
/// (tests/serve/client.py, scenario_soak).
#[test]
fn soak_random_load_leaves_the_server_as_it_found_it() {
    let mef = smollm2();
    let seconds: u64 = std::env::var("MAXC_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    let h = &a.header;
    let per_block = h.batch.unwrap().block_bytes(&h.kv_cache).unwrap() * 2 * h.kv_cache.layers;
    // One full context's blocks, the least the server takes: two of the long
    // requests (a third to two thirds of the context each) run it out.
    let blocks = h.max_length.div_ceil(16);
    let pool = (blocks * per_block).to_string();
    let greedy: Vec<Value> = PROMPTS[..4].iter().map(|p| json!({"prompt": p, "max_tokens": 24, "text": cli_prompt(mef, p, 24).0})).collect();
    let mut server = Server::start(mef, &["--kv-cache-memory", &pool, "--max-queue", "6"]);
    let expected = json!({
        "model": SMOLLM2_SERVED,
        "concurrent": greedy,
        "pid": server.child.id(),
        "seconds": seconds,
        "clients": 8,
        "max_length": h.max_length,
    });
    let out = client_within("soak", &server.url, &expected, seconds + 400).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "soak failed:\n{}\n{}\nserver log (tail):\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        server.log().lines().rev().take(40).collect::<Vec<_>>().join("\n")
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(server.stop(Duration::from_secs(60)), 0, "{}", server.log());
}

/// A free loopback port (bound, then released for the process that takes it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A metric's value on `url`'s `/metrics` (0 when absent).
fn metric(url: &str, name: &str) -> f64 {
    let out = Command::new("curl").args(["-s", "-m", "10", &format!("{url}/metrics")]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// A running sglang-router (PyPI `sglang-router`, which scripts/setup.sh puts
/// in .cache/sglang-router) in front of `workers`.
struct SglangRouter {
    child: Child,
    url: String,
}

impl SglangRouter {
    fn start(workers: &[&str], policy: &str) -> SglangRouter {
        let (port, prometheus) = (free_port(), free_port());
        let log = std::fs::File::create(temp_dir("sglang-router").keep().join("router.log")).unwrap();
        let mut child = Command::new("python3")
            .args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &port.to_string(), "--prometheus-port", &prometheus.to_string(), "--policy", policy, "--worker-urls"])
            .args(workers)
            .env("PYTHONPATH", workspace_root().join(".cache/sglang-router"))
            .env("NO_PROXY", "127.0.0.1,localhost")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("python3 starts the router");
        let url = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            let out = Command::new("curl").args(["-s", "-m", "5", &format!("{url}/v1/models")]).output().unwrap();
            if String::from_utf8_lossy(&out.stdout).contains("\"data\"") {
                break;
            }
            if start.elapsed() > Duration::from_secs(90) || child.try_wait().unwrap().is_some() {
                let _ = child.kill();
                panic!("sglang-router did not come up in front of {workers:?}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        SglangRouter { child, url }
    }
}

impl Drop for SglangRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the sessions traffic (tests/serve/client.py, scenario_sessions) against
/// `url`; returns its report.
fn sessions(url: &str, expected: &Value) -> Value {
    let out = client_within("sessions", url, expected, 900).wait_with_output().unwrap();
    assert!(out.status.success(), "sessions through {url}:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout.lines().find_map(|l| serde_json::from_str(l).ok()).unwrap_or_else(|| panic!("no report from the sessions: {stdout}"))
}

/// Issue #67: three replicas with default flags behind sglang-router 0.3.2's
/// cache-aware policy keep the prefix caches as warm as one replica that holds
/// everything: 24 six-turn chat sessions sharing a system prompt, each turn
/// resending the conversation, 6 at a time. The prompt tokens found in the
/// replicas' prefix caches (summed over their `/metrics`) reach 95% of what
/// one replica finds on the same traffic; round robin is printed beside them
/// as the baseline. The router must list the replicas' model under its id.
#[test]
fn replicas_behind_sglang_router_keep_their_prefix_caches() {
    let mef = smollm2();
    let expected = json!({"model": SMOLLM2_SERVED, "sessions": 24, "turns": 6, "concurrency": 6, "reply_tokens": 24});
    let hits = |servers: &[Server]| -> (f64, f64) {
        servers.iter().fold((0.0, 0.0), |(h, q), s| (h + metric(&s.url, "maxrun_prefix_cache_hit_tokens"), q + metric(&s.url, "maxrun_prefix_cache_queried_tokens")))
    };
    // The ideal: one replica whose pool holds all of it.
    let mut one = Server::start(mef, &[]);
    let alone = sessions(&one.url, &expected);
    let (ideal, queried) = hits(std::slice::from_ref(&one));
    assert_eq!(one.stop(Duration::from_secs(60)), 0, "{}", one.log());
    assert!(ideal > 0.5 * queried, "one replica finds most of each resent conversation: {ideal} of {queried}");
    let mut report = vec![format!("one replica: {ideal} of {queried} prompt tokens from the cache, {alone}")];
    for policy in ["cache_aware", "round_robin"] {
        let replicas: Vec<Server> = (0..3).map(|_| Server::start(mef, &["--threads", "1"])).collect();
        let urls: Vec<&str> = replicas.iter().map(|s| s.url.as_str()).collect();
        let router = SglangRouter::start(&urls, policy);
        let models = Command::new("curl").args(["-s", "-m", "10", &format!("{}/v1/models", router.url)]).output().unwrap();
        let models: Value = serde_json::from_slice(&models.stdout).unwrap();
        assert_eq!(models["data"][0]["id"], SMOLLM2_SERVED, "the router lists the replicas' model: {models}");
        let run = sessions(&router.url, &expected);
        let (found, asked) = hits(&replicas);
        report.push(format!("{policy}: {found} of {asked} prompt tokens from the caches ({:.1}% of the ideal), {run}", 100.0 * found / ideal));
        drop(router);
        for mut r in replicas {
            assert_eq!(r.stop(Duration::from_secs(60)), 0, "{}", r.log());
        }
        if policy == "cache_aware" {
            assert!(found >= 0.95 * ideal, "cache-aware routing: {found} prompt tokens from the caches, under 95% of one replica's {ideal}\n{}", report.join("\n"));
        }
    }
    eprintln!("{}", report.join("\n"));
}
