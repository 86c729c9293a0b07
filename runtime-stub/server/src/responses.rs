//! `POST /v1/responses`, OpenAI's Responses API as the OpenAI Agents SDK and
//! Codex-style clients speak it, and `GET` / `DELETE /v1/responses/{id}`.
//!
//! A request's `input` items (messages, function calls and their outputs),
//! after those of the response it continues (`previous_response_id`, from the
//! store of `response_store.rs`) and its `instructions`, become chat messages
//! and take the chat completions' path to the engine (`routes::prepare_chat`:
//! the chat template, tools, tool choices and grammars alike). The reply is
//! read by the same reasoning and tool-call parsers and comes back as output
//! items (a reasoning item, a message, function calls), whole or as the
//! Responses API's events; one [`Builder`] makes both, so a streamed response
//! ends with exactly the object a whole one returns. Every field is honoured
//! or refused with a 400 naming it (built-in tools, files, images,
//! `background`, `include` values).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc as tmpsc;

use super::errors::ApiError;
use super::openai::{self, field, ToolChoice};
use super::routes::{log_request, now_secs, prepare_chat, respond, AppState, ChatAsk, InFlight, ToolReply};
use super::worker::{Job, Update};
use maxrun_engine::constrain::reasoning::ThinkSplitter;
use maxrun_engine::constrain::tools::{CallDelta, Tool, ToolStream};
use maxrun_engine::constrain::Grammar;
use maxrun_engine::{FinishReason, Usage};

type St = State<Arc<AppState>>;

const ENDPOINT: &str = "/v1/responses";

/// Every field a `/v1/responses` request may have.
pub const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "include",
    "metadata",
    "user",
    "truncation",
    "reasoning",
    "background",
    "top_logprobs",
];

/// Fields of the Responses API that maxrun knows and cannot honour: refused by
/// name even with `--allow-extra-request-fields`, since dropping them would
/// answer another request than the one sent.
const NOT_SUPPORTED: &[(&str, &str)] = &[
    ("conversation", "conversation objects are not supported; continue a response with `previous_response_id`, or send the whole conversation as `input`"),
    ("prompt", "stored prompt templates are not supported; send `input` and `instructions`"),
    ("context_management", "server-side compaction is not supported; send the conversation to keep as `input`"),
    ("max_tool_calls", "built-in tools are not supported, so there are no built-in tool calls to limit"),
];

/// `POST /v1/responses` (its fields are checked by hand where the API's
/// unions need the place named: `input[3].content[0].type`).
#[derive(Clone, Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<Value>,
    max_output_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not OpenAI's (its Responses API has no seed): as in Chat Completions, a
    /// sampled reply is reproducible with one; without one each request draws
    /// its own.
    seed: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<Value>,
    store: Option<bool>,
    previous_response_id: Option<String>,
    include: Option<Vec<String>>,
    metadata: Option<Map<String, Value>>,
    user: Option<String>,
    truncation: Option<String>,
    reasoning: Option<Value>,
    background: Option<bool>,
    top_logprobs: Option<u64>,
}

/// One turn of a conversation as the Responses API's items carry it; what the
/// store keeps of a response to continue it.
#[derive(Clone, Debug, PartialEq)]
pub enum Turn {
    Message { role: String, text: String },
    Call { call_id: String, name: String, arguments: String },
    Output { call_id: String, output: String },
    /// Kept with its response and not written into prompts: the chat templates
    /// that think drop earlier turns' thinking themselves, and the call format
    /// maxrun gives templates without tool support has no place for it.
    Reasoning { text: String },
}

impl Turn {
    fn bytes(&self) -> usize {
        match self {
            Turn::Message { role, text } => role.len() + text.len(),
            Turn::Call { call_id, name, arguments } => call_id.len() + name.len() + arguments.len(),
            Turn::Output { call_id, output } => call_id.len() + output.len(),
            Turn::Reasoning { text } => text.len(),
        }
    }
}

/// A stored response: the object `GET` returns, and the conversation (its
/// input after the one it continued, and its output; not its instructions, as
/// OpenAI's) that a request continuing it starts from.
pub struct StoredResponse {
    pub response: Value,
    pub conversation: Vec<Turn>,
}

/// A new id with OpenAI's prefix (`resp`, `msg`, `fc`, `call`, `rs`): 128
/// random bits, so that ids from replicas behind one router never meet.
fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut words = [0u64; 2];
    for w in &mut words {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        *w = h.finish();
    }
    format!("{prefix}_{:016x}{:016x}", words[0], words[1])
}

/// Refuses an object's keys that are not among `known`, naming `at.key`
/// (unless `allow_extra`, `--allow-extra-request-fields`).
fn known_keys(v: &Map<String, Value>, known: &[&str], at: &str, allow_extra: bool) -> Result<(), ApiError> {
    match v.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) if !allow_extra => Err(field(&format!("{at}.{k}"), format!("unknown field `{k}` of {at}; see docs/serving.md for what /v1/responses takes"))),
        _ => Ok(()),
    }
}

fn string_at<'a>(v: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    match v.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(field(&format!("{at}.{key}"), format!("{at}.{key} must be a string, not {other}"))),
        None => Err(field(&format!("{at}.{key}"), format!("{at} has no `{key}`"))),
    }
}

/// The text of content parts (`input_text`, `output_text`, `refusal`);
/// images, files and audio are refused by name.
fn parts_text(parts: &[Value], at: &str, allow_extra: bool) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let Some(p) = p.as_object() else { return Err(field(&at, format!("{at} must be a content part object"))) };
        match p.get("type").and_then(Value::as_str) {
            Some("input_text") => {
                known_keys(p, &["type", "text"], &at, allow_extra)?;
                text.push_str(string_at(p, "text", &at)?);
            }
            Some("output_text") => {
                // What an earlier response's message carries back: its
                // annotations and log-probabilities say nothing to the model.
                known_keys(p, &["type", "text", "annotations", "logprobs"], &at, allow_extra)?;
                text.push_str(string_at(p, "text", &at)?);
            }
            Some("refusal") => {
                known_keys(p, &["type", "refusal"], &at, allow_extra)?;
                text.push_str(string_at(p, "refusal", &at)?);
            }
            Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                return Err(field(&format!("{at}.type"), format!("`{kind}` content is not supported: this server's models read text; send input_text")));
            }
            Some(kind) => return Err(field(&format!("{at}.type"), format!("content part type `{kind}` is not supported; use input_text (or output_text for an assistant's words)"))),
            None => return Err(field(&format!("{at}.type"), format!("{at} has no `type`"))),
        }
    }
    Ok(text)
}

/// The turns of `input` (a string: one user message; or a list of items),
/// after `earlier` (the conversation it continues, whose calls its function
/// call outputs may answer).
fn parse_input(input: &Value, earlier: &[Turn], allow_extra: bool) -> Result<Vec<Turn>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![Turn::Message { role: "user".into(), text: s.clone() }]),
        Value::Array(items) => items,
        other => return Err(field("input", format!("input must be a string or a list of items, not {other}"))),
    };
    let mut turns: Vec<Turn> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Some(m) = item.as_object() else { return Err(field(&at, format!("{at} must be an item object"))) };
        // A message may leave out its type (OpenAI's "easy input message").
        let kind = match m.get("type") {
            None if m.contains_key("role") => "message",
            None => return Err(field(&format!("{at}.type"), format!("{at} has neither `type` nor `role`"))),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => return Err(field(&format!("{at}.type"), format!("{at}.type must be a string, not {other}"))),
        };
        let turn = match kind {
            "message" => {
                known_keys(m, &["type", "role", "content", "id", "status", "phase"], &at, allow_extra)?;
                let role = string_at(m, "role", &at)?;
                if !["user", "system", "developer", "assistant"].contains(&role) {
                    return Err(field(&format!("{at}.role"), format!("role `{role}` is not supported; use user, system, developer or assistant")));
                }
                let text = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(parts, &format!("{at}.content"), allow_extra)?,
                    Some(other) => return Err(field(&format!("{at}.content"), format!("content must be a string or a list of content parts, not {other}"))),
                    None => return Err(field(&format!("{at}.content"), format!("{at} has no `content`"))),
                };
                Turn::Message { role: role.to_string(), text }
            }
            "function_call" => {
                known_keys(m, &["type", "id", "call_id", "name", "arguments", "status"], &at, allow_extra)?;
                let arguments = string_at(m, "arguments", &at)?;
                if let Err(e) = serde_json::from_str::<Value>(arguments) {
                    return Err(field(&format!("{at}.arguments"), format!("arguments must be JSON text: {e}")));
                }
                Turn::Call { call_id: string_at(m, "call_id", &at)?.to_string(), name: string_at(m, "name", &at)?.to_string(), arguments: arguments.to_string() }
            }
            "function_call_output" => {
                known_keys(m, &["type", "id", "call_id", "output", "status"], &at, allow_extra)?;
                let call_id = string_at(m, "call_id", &at)?;
                let called = |t: &Turn| matches!(t, Turn::Call { call_id: c, .. } if c == call_id);
                if !earlier.iter().chain(&turns).any(called) {
                    return Err(field(&format!("{at}.call_id"), format!("no function call with call_id `{call_id}` comes before this output (in input or the previous response)")));
                }
                let output = match m.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(parts, &format!("{at}.output"), allow_extra)?,
                    Some(other) => return Err(field(&format!("{at}.output"), format!("output must be a string or a list of content parts, not {other}"))),
                    None => return Err(field(&format!("{at}.output"), format!("{at} has no `output`"))),
                };
                Turn::Output { call_id: call_id.to_string(), output }
            }
            "reasoning" => {
                known_keys(m, &["type", "id", "summary", "content", "encrypted_content", "status"], &at, allow_extra)?;
                if m.get("encrypted_content").is_some_and(|v| !v.is_null()) {
                    return Err(field(&format!("{at}.encrypted_content"), "encrypted reasoning is not supported (maxrun never sends it); send the reasoning item as it came back".into()));
                }
                let text = match m.get("content") {
                    Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<String>(),
                    _ => String::new(),
                };
                Turn::Reasoning { text }
            }
            "item_reference" => return Err(field(&format!("{at}.type"), "item references are not supported; send the item itself, or continue its response with previous_response_id".into())),
            other => return Err(field(&format!("{at}.type"), format!("input items of type `{other}` are not supported (built-in tools are not served); send message, function_call, function_call_output or reasoning items"))),
        };
        turns.push(turn);
    }
    Ok(turns)
}

/// The chat messages of a conversation: `instructions` as the system message
/// first, each function call with the assistant message before it (or one of
/// its own), each output as a `tool` message naming its call.
fn chat_messages(instructions: Option<&str>, turns: &[Turn]) -> Vec<openai::ChatMessage> {
    let message = |role: &str, text: Option<&str>| openai::ChatMessage { role: role.into(), content: text.map(|t| json!(t)), name: None, tool_calls: None, tool_call_id: None };
    let mut out: Vec<openai::ChatMessage> = Vec::with_capacity(turns.len() + 1);
    if let Some(i) = instructions {
        out.push(message("system", Some(i)));
    }
    for (k, t) in turns.iter().enumerate() {
        match t {
            Turn::Message { role, text } => out.push(message(role, Some(text))),
            Turn::Call { call_id, name, arguments } => {
                let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
                match out.last_mut().filter(|m| m.role == "assistant") {
                    Some(m) => m.tool_calls.get_or_insert_with(Vec::new).push(call),
                    None => {
                        let mut m = message("assistant", None);
                        m.tool_calls = Some(vec![call]);
                        out.push(m);
                    }
                }
            }
            Turn::Output { call_id, output } => {
                let name = turns[..k].iter().rev().find_map(|t| match t {
                    Turn::Call { call_id: c, name, .. } if c == call_id => Some(name.clone()),
                    _ => None,
                });
                let mut m = message("tool", Some(output));
                m.tool_call_id = Some(call_id.clone());
                m.name = name;
                out.push(m);
            }
            Turn::Reasoning { .. } => {}
        }
    }
    out
}

/// The offered function tools in the Responses API's shape (`{"type":
/// "function", "name", "description", "parameters", "strict"}`), checked, and
/// as the response echoes them. Built-in tools are refused by name.
fn parse_tools(tools: &Option<Vec<Value>>, allow_extra: bool) -> Result<(Vec<Tool>, Vec<Value>), ApiError> {
    let (mut out, mut echo): (Vec<Tool>, Vec<Value>) = (Vec::new(), Vec::new());
    for (i, t) in tools.iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        let Some(m) = t.as_object() else { return Err(field(&at, format!("{at} must be a tool object"))) };
        match m.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(kind) => return Err(field(&format!("{at}.type"), format!("tool type `{kind}` is not supported: maxrun serves function tools only (no built-in tools such as web or file search)"))),
            None => return Err(field(&format!("{at}.type"), format!("{at} has no `type`"))),
        }
        known_keys(m, &["type", "name", "description", "parameters", "strict"], &at, allow_extra)?;
        let name = string_at(m, "name", &at)?;
        let description = match m.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => return Err(field(&format!("{at}.description"), format!("description must be a string, not {other}"))),
        };
        let parameters = m.get("parameters").filter(|p| !p.is_null()).cloned();
        let strict = match m.get("strict") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(field(&format!("{at}.strict"), format!("strict must be true or false, not {other}"))),
        };
        let tool = openai::function_tool(&out, &at, name, description.clone(), parameters)?;
        // The Responses API's function tools are strict unless they say otherwise.
        echo.push(json!({"type": "function", "name": tool.name, "description": description, "parameters": tool.parameters, "strict": strict}));
        out.push(tool);
    }
    Ok((out, echo))
}

/// `tool_choice` in the Responses API's shape: `none`, `auto`, `required` or
/// `{"type": "function", "name": ...}`; with the value the response echoes.
fn parse_tool_choice(choice: &Option<Value>, tools: &[Tool]) -> Result<(ToolChoice, Value), ApiError> {
    let parsed = match choice {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(field("tool_choice", format!("`{other}`: use none, auto, required or {{\"type\": \"function\", \"name\": ...}}"))),
        },
        Some(Value::Object(m)) => match m.get("type").and_then(Value::as_str) {
            Some("function") => match m.get("name").and_then(Value::as_str) {
                Some(name) if m.len() == 2 => ToolChoice::Named(name.to_string()),
                _ => return Err(field("tool_choice", "a function tool choice is {\"type\": \"function\", \"name\": ...}".into())),
            },
            Some("allowed_tools") => return Err(field("tool_choice", "allowed_tools is not supported; offer only the tools the model may call".into())),
            Some(kind) => return Err(field("tool_choice", format!("tool choice type `{kind}` is not supported: maxrun serves function tools only"))),
            None => return Err(field("tool_choice", "a tool choice object needs a `type`".into())),
        },
        Some(other) => return Err(field("tool_choice", format!("{other} is not a tool choice"))),
    };
    match &parsed {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => return Err(field("tool_choice", "a tool is required but the request offers no tools".into())),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => return Err(field("tool_choice", format!("`{n}` is not one of the offered tools"))),
        _ => {}
    }
    let echo = match &parsed {
        // OpenAI says `auto` of a request that set no choice, with tools or without.
        ToolChoice::None if choice.as_ref().is_none_or(Value::is_null) => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Auto => json!("auto"),
        ToolChoice::Required => json!("required"),
        ToolChoice::Named(n) => json!({"type": "function", "name": n}),
    };
    Ok((parsed, echo))
}

/// A grammar and the request field that set it.
type FieldGrammar = Option<(&'static str, Grammar)>;

/// `text` (`{"format": ...}`): `text`, `json_object`, or `json_schema` with
/// `name`, `schema`, `strict`, `description`, held to the grammar as a chat
/// request's `response_format` is (objects closed to their declared
/// properties); with the value the response echoes.
fn parse_text(text: &Option<Value>, allow_extra: bool) -> Result<(FieldGrammar, Value), ApiError> {
    let plain = json!({"format": {"type": "text"}});
    let Some(text) = text.as_ref().filter(|t| !t.is_null()) else { return Ok((None, plain)) };
    let Some(t) = text.as_object() else { return Err(field("text", format!("text must be an object like {{\"format\": {{\"type\": \"json_schema\", ...}}}}, not {text}"))) };
    known_keys(t, &["format", "verbosity"], "text", allow_extra)?;
    match t.get("verbosity") {
        None | Some(Value::Null) => {}
        Some(Value::String(v)) if v == "medium" => {}
        Some(v) => return Err(field("text.verbosity", format!("verbosity {v} cannot be honoured: a model here writes as it writes; leave it out (or `medium`)"))),
    }
    let Some(format) = t.get("format").filter(|f| !f.is_null()) else { return Ok((None, plain)) };
    let Some(f) = format.as_object() else { return Err(field("text.format", format!("text.format must be an object, not {format}"))) };
    let grammar = match f.get("type").and_then(Value::as_str) {
        Some("text") => {
            known_keys(f, &["type"], "text.format", allow_extra)?;
            None
        }
        Some("json_object") => {
            known_keys(f, &["type"], "text.format", allow_extra)?;
            Some(("text.format", Grammar::JsonObject))
        }
        Some("json_schema") => {
            known_keys(f, &["type", "name", "schema", "strict", "description"], "text.format", allow_extra)?;
            let name = string_at(f, "name", "text.format")?.to_string();
            let schema = f.get("schema").cloned().ok_or_else(|| field("text.format.schema", "a json_schema format needs `schema`".into()))?;
            let strict = f.get("strict").and_then(Value::as_bool);
            let description = f.get("description").and_then(Value::as_str).map(str::to_string);
            let response_format = openai::ResponseFormat::JsonSchema { json_schema: openai::JsonSchemaFormat { name, description, schema: Some(schema), strict } };
            // The chat path's checks, which name its own field.
            let g = openai::grammar(&Some(response_format), &openai::Guided::default())
                .map_err(|e| ApiError { param: Some("text.format".into()), message: e.message.replace("json_schema.schema", "text.format.schema"), ..e })?;
            g.map(|(_, g)| ("text.format", g))
        }
        Some(kind) => return Err(field("text.format.type", format!("format `{kind}` is not supported; use text, json_object or json_schema"))),
        None => return Err(field("text.format.type", "text.format has no `type`".into())),
    };
    Ok((grammar, json!({"format": format})))
}

/// Refuses what cannot be honoured among the fields that only have a
/// default maxrun can give.
fn check_defaults_only(r: &ResponsesRequest) -> Result<(), ApiError> {
    if r.background == Some(true) {
        return Err(field("background", "background responses are not supported; send the request with stream or wait for it".into()));
    }
    match r.truncation.as_deref() {
        None | Some("disabled") => {}
        Some("auto") => return Err(field("truncation", "truncation `auto` (dropping the conversation's first items to fit) is not supported; a prompt past the context is a 400".into())),
        Some(other) => return Err(field("truncation", format!("truncation `{other}`: use disabled"))),
    }
    if let Some(reasoning) = r.reasoning.as_ref().filter(|v| !v.is_null()) {
        let Some(m) = reasoning.as_object() else { return Err(field("reasoning", format!("reasoning must be an object, not {reasoning}"))) };
        if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_null()) {
            return Err(field(&format!("reasoning.{k}"), format!("reasoning.{k} = {v} cannot be honoured: a model here thinks as its chat template lets it; leave it out")));
        }
    }
    if let Some(v) = r.include.iter().flatten().next() {
        return Err(field("include", format!("`{v}` cannot be included: maxrun has no built-in tools, encrypted reasoning or output log-probabilities on /v1/responses; send include: []")));
    }
    if r.top_logprobs.is_some_and(|n| n > 0) {
        return Err(field("top_logprobs", "log-probabilities are not supported on /v1/responses; use /v1/chat/completions with logprobs".into()));
    }
    if let Some(o) = r.stream_options.as_ref().filter(|v| !v.is_null()) {
        if r.stream != Some(true) {
            return Err(field("stream_options", "stream_options goes with stream = true".into()));
        }
        let Some(m) = o.as_object() else { return Err(field("stream_options", format!("stream_options must be an object, not {o}"))) };
        known_keys(m, &["include_obfuscation"], "stream_options", false)?;
        if m.get("include_obfuscation").and_then(Value::as_bool) == Some(true) {
            return Err(field("stream_options.include_obfuscation", "stream obfuscation is not supported (loopback and trusted networks need none); leave it out or send false".into()));
        }
    }
    if let Some(m) = &r.metadata {
        if m.len() > 16 {
            return Err(field("metadata", format!("{} metadata keys; at most 16", m.len())));
        }
        for (k, v) in m {
            if k.chars().count() > 64 || v.as_str().is_none_or(|s| s.chars().count() > 512) {
                return Err(field("metadata", format!("metadata `{k}`: keys of at most 64 characters with string values of at most 512")));
            }
        }
    }
    Ok(())
}

/// What a response object says of its request, the same in every event.
struct Frame {
    id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    parallel_tool_calls: bool,
    previous_response_id: Option<String>,
    temperature: f32,
    top_p: f32,
    text: Value,
    tool_choice: Value,
    tools: Vec<Value>,
    metadata: Value,
    user: Option<String>,
}

impl Frame {
    /// The response object.
    fn response(&self, status: &str, output: Vec<Value>, usage: Option<Value>, incomplete: Option<&str>, error: Option<Value>) -> Value {
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": error,
            "incomplete_details": incomplete.map(|reason| json!({"reason": reason})),
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": self.user,
        })
    }
}

/// What an output item is.
#[derive(Clone, Debug, PartialEq)]
enum ItemKind {
    Reasoning,
    Message,
    Call { call_id: String, name: String },
}

/// One output item: its text is the reasoning, the message's text or the
/// call's arguments.
#[derive(Clone, Debug)]
struct Item {
    id: String,
    kind: ItemKind,
    text: String,
    status: &'static str,
}

impl Item {
    /// The item as the response lists it (`whole`: with its content so far;
    /// else as `response.output_item.added` opens it).
    fn json(&self, whole: bool) -> Value {
        match &self.kind {
            ItemKind::Reasoning => {
                let content = if whole { json!([{"type": "reasoning_text", "text": self.text}]) } else { json!([]) };
                json!({"id": self.id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": null, "status": self.status})
            }
            ItemKind::Message => {
                let content = if whole { json!([{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]) } else { json!([]) };
                json!({"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content})
            }
            ItemKind::Call { call_id, name } => {
                json!({"id": self.id, "type": "function_call", "call_id": call_id, "name": name, "arguments": if whole { self.text.as_str() } else { "" }, "status": self.status})
            }
        }
    }

    fn turn(&self) -> Turn {
        match &self.kind {
            ItemKind::Reasoning => Turn::Reasoning { text: self.text.clone() },
            ItemKind::Message => Turn::Message { role: "assistant".into(), text: self.text.clone() },
            ItemKind::Call { call_id, name } => Turn::Call { call_id: call_id.clone(), name: name.clone(), arguments: self.text.clone() },
        }
    }
}

/// Turns a reply's text, as it comes, into output items and the Responses
/// API's events: `response.created` and `response.in_progress`; for each item
/// `response.output_item.added`, its content part's `added`, its deltas
/// (`response.reasoning_text.delta`, `response.output_text.delta`,
/// `response.function_call_arguments.delta`), their `done`, the part's
/// `done` and `response.output_item.done`; then `response.completed` (or
/// `response.incomplete` when the token limit cut it), each event numbered
/// by `sequence_number`. The text goes through the reasoning parser, then the
/// tool-call parser: the thinking becomes a reasoning item, text a message,
/// each call a function call item.
struct Builder {
    frame: Arc<Frame>,
    sequence: u64,
    think: Option<ThinkSplitter>,
    calls: Option<ToolStream>,
    max_calls: Option<usize>,
    items: Vec<Item>,
    /// The last item is still being written.
    open: bool,
    /// Whitespace of the reply not yet in a message: a message opens only
    /// for text that is more than whitespace (the newline before a call is not one).
    held: String,
    /// Generated tokens whose text went to the reasoning.
    reasoning_tokens: usize,
    events: Vec<Value>,
}

impl Builder {
    fn new(frame: Arc<Frame>, think: Option<bool>, tools: Option<ToolReply>) -> Builder {
        let mut b = Builder {
            frame,
            sequence: 0,
            think: think.map(ThinkSplitter::new),
            calls: tools.map(|t| ToolStream::new(t.format, t.forced)),
            max_calls: tools.and_then(|t| t.max_calls),
            items: Vec::new(),
            open: false,
            held: String::new(),
            reasoning_tokens: 0,
            events: Vec::new(),
        };
        let created = b.frame.response("in_progress", vec![], None, None, None);
        b.emit("response.created", json!({"response": created.clone()}));
        b.emit("response.in_progress", json!({"response": created}));
        b
    }

    fn emit(&mut self, kind: &str, mut event: Value) {
        event["type"] = json!(kind);
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.events.push(event);
    }

    fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// The open item's index, if it is of `kind`.
    fn open_of(&self, kind: impl Fn(&ItemKind) -> bool) -> Option<usize> {
        (self.open && self.items.last().is_some_and(|i| kind(&i.kind))).then(|| self.items.len() - 1)
    }

    /// Opens a new item (closing the one before).
    fn start(&mut self, kind: ItemKind) -> usize {
        self.close("completed");
        let prefix = match kind {
            ItemKind::Reasoning => "rs",
            ItemKind::Message => "msg",
            ItemKind::Call { .. } => "fc",
        };
        let item = Item { id: new_id(prefix), kind, text: String::new(), status: "in_progress" };
        let index = self.items.len();
        let (id, added) = (item.id.clone(), item.json(false));
        let part = match &item.kind {
            ItemKind::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
            ItemKind::Message => Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})),
            ItemKind::Call { .. } => None,
        };
        self.items.push(item);
        self.open = true;
        self.emit("response.output_item.added", json!({"output_index": index, "item": added}));
        if let Some(part) = part {
            self.emit("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}));
        }
        index
    }

    /// Closes the open item with `status`.
    fn close(&mut self, status: &'static str) {
        if !self.open {
            return;
        }
        self.open = false;
        let index = self.items.len() - 1;
        let item = &mut self.items[index];
        item.status = status;
        let (id, text, done) = (item.id.clone(), item.text.clone(), item.json(true));
        match &item.kind {
            ItemKind::Reasoning => {
                self.emit("response.reasoning_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}));
                self.emit("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": text}}));
            }
            ItemKind::Message => {
                self.emit("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                self.emit("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}));
            }
            ItemKind::Call { .. } => self.emit("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "arguments": text})),
        }
        self.emit("response.output_item.done", json!({"output_index": index, "item": done}));
    }

    fn reasoning(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let index = match self.open_of(|k| *k == ItemKind::Reasoning) {
            Some(i) => i,
            None => self.start(ItemKind::Reasoning),
        };
        self.items[index].text.push_str(text);
        let id = self.items[index].id.clone();
        self.emit("response.reasoning_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}));
    }

    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let (index, delta) = match self.open_of(|k| *k == ItemKind::Message) {
            Some(i) => (i, text.to_string()),
            None => {
                self.held.push_str(text);
                if self.held.trim().is_empty() {
                    return;
                }
                let delta = std::mem::take(&mut self.held);
                (self.start(ItemKind::Message), delta)
            }
        };
        self.message_delta(index, delta);
    }

    fn message_delta(&mut self, index: usize, delta: String) {
        self.items[index].text.push_str(&delta);
        let id = self.items[index].id.clone();
        self.emit("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []}));
    }

    fn call_deltas(&mut self, deltas: Vec<CallDelta>) {
        for d in deltas {
            match d {
                CallDelta::Head { name, .. } => {
                    // Whitespace before a call is no message.
                    self.held.clear();
                    self.start(ItemKind::Call { call_id: new_id("call"), name });
                }
                CallDelta::Arguments { text, .. } => {
                    let Some(index) = self.open_of(|k| matches!(k, ItemKind::Call { .. })) else { continue };
                    self.items[index].text.push_str(&text);
                    let id = self.items[index].id.clone();
                    self.emit("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": text}));
                }
            }
        }
    }

    /// The next token's text.
    fn push(&mut self, text: &str) {
        let (reasoning, content) = match &mut self.think {
            Some(t) => t.push(text),
            None => (String::new(), text.to_string()),
        };
        if !reasoning.is_empty() {
            self.reasoning_tokens += 1;
        }
        self.reasoning(&reasoning);
        let (content, deltas) = match &mut self.calls {
            Some(c) => {
                let visible = c.push(&content);
                (visible, c.deltas())
            }
            None => (content, vec![]),
        };
        self.content(&content);
        self.call_deltas(deltas);
    }

    /// The end of the reply (`text`: what the engine held back to the end):
    /// the last items closed and the response's last event. Returns the
    /// response object and the output's turns.
    fn finish(&mut self, reason: FinishReason, text: &str, usage: &Usage) -> (Value, Vec<Turn>) {
        let (reasoning, mut content) = match &mut self.think {
            Some(t) => {
                let (r1, c1) = t.push(text);
                let (r2, c2) = t.finish();
                (r1 + &r2, c1 + &c2)
            }
            None => (String::new(), text.to_string()),
        };
        self.reasoning(&reasoning);
        let mut deltas = vec![];
        if let Some(c) = &mut self.calls {
            let sent = c.push(&content);
            let (_, rest, last) = c.finish(self.max_calls);
            content = sent + &rest;
            deltas = last;
        }
        self.content(&content);
        self.call_deltas(deltas);
        if self.items.is_empty() {
            // A reply of nothing (or only whitespace) is an empty message.
            let index = self.start(ItemKind::Message);
            let held = std::mem::take(&mut self.held);
            if !held.is_empty() {
                self.message_delta(index, held);
            }
        }
        let (status, incomplete, last) = match reason {
            FinishReason::Stop => ("completed", None, "response.completed"),
            FinishReason::Length => ("incomplete", Some("max_output_tokens"), "response.incomplete"),
            // The server shut down first.
            FinishReason::Cancelled => ("cancelled", None, "response.failed"),
        };
        self.close(if status == "completed" { "completed" } else { "incomplete" });
        let error = (reason == FinishReason::Cancelled).then(|| json!({"code": "server_error", "message": "the server shut down before the response was finished"}));
        let usage = json!({
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        });
        let output = self.items.iter().map(|i| i.json(true)).collect();
        let response = self.frame.response(status, output, Some(usage), incomplete, error);
        self.emit(last, json!({"response": response.clone()}));
        (response, self.items.iter().map(Item::turn).collect())
    }

    /// The engine failed: an `error` event, then `response.failed`.
    fn fail(&mut self, e: &ApiError) -> Value {
        self.close("incomplete");
        self.emit("error", json!({"code": e.code, "message": e.message, "param": e.param}));
        let output = self.items.iter().map(|i| i.json(true)).collect();
        let response = self.frame.response("failed", output, None, None, Some(json!({"code": "server_error", "message": e.message})));
        self.emit("response.failed", json!({"response": response.clone()}));
        response
    }
}

/// A response on its way: its updates, its builder, and what storing it needs.
struct Running {
    st: Arc<AppState>,
    rx: tmpsc::UnboundedReceiver<Update>,
    builder: Builder,
    /// The conversation before the output, when the response is to be stored.
    store: Option<Vec<Turn>>,
    started: Instant,
    _guard: InFlight,
}

impl Running {
    /// Takes the next update; returns the finished response object, or the
    /// error, at the end.
    async fn step(&mut self) -> Option<Result<Value, ApiError>> {
        match self.rx.recv().await {
            Some(Update::Token { text, .. }) => {
                self.builder.push(&text);
                None
            }
            Some(Update::PromptLogprob(_)) => None,
            Some(Update::Finished { reason, text, usage }) => {
                let (response, output) = self.builder.finish(reason, &text, &usage);
                let id = self.builder.frame.id.clone();
                log_request(&id, ENDPOINT, 200, Some((usage.prompt_tokens, usage.completion_tokens)), self.started, Some(response["status"].as_str().unwrap_or("")));
                if let Some(mut conversation) = self.store.take().filter(|_| reason != FinishReason::Cancelled) {
                    conversation.extend(output);
                    let bytes = response.to_string().len() + conversation.iter().map(Turn::bytes).sum::<usize>();
                    self.st.responses.lock().expect("never poisoned").insert(id, StoredResponse { response: response.clone(), conversation }, bytes);
                }
                Some(Ok(response))
            }
            Some(Update::Failed(e)) => Some(Err(e)),
            None => Some(Err(ApiError::internal("the engine's thread ended"))),
        }
    }
}

pub async fn create(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = new_id("resp");
    let result = create_inner(&st, &headers, &body, &id, started).await;
    respond(&st, ENDPOINT, &id, started, result)
}

async fn create_inner(st: &Arc<AppState>, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let allow_extra = st.allow_extra_fields;
    let (r, _): (ResponsesRequest, _) = openai::parse_refusing(body, RESPONSES_FIELDS, false, allow_extra, NOT_SUPPORTED)?;
    st.check_model(&r.model)?;
    if st.info.encoder {
        return Err(ApiError::invalid("this model is a sentence encoder: use /v1/embeddings", Some("model".into())));
    }
    check_defaults_only(&r)?;
    let earlier: Vec<Turn> = match &r.previous_response_id {
        Some(prev) => match st.responses.lock().expect("never poisoned").get(prev) {
            Some(stored) => stored.conversation.clone(),
            None => return Err(ApiError::response_not_found(prev, Some("previous_response_id"))),
        },
        None => vec![],
    };
    let new = match &r.input {
        Some(input) => parse_input(input, &earlier, allow_extra)?,
        None if r.previous_response_id.is_some() => vec![],
        None => return Err(field("input", "send `input`: a string or a list of items".into())),
    };
    let mut turns = earlier;
    turns.extend(new);
    if !turns.iter().any(|t| matches!(t, Turn::Message { .. } | Turn::Output { .. })) {
        return Err(field("input", "input has no message or function call output to answer".into()));
    }
    let (offered, tools_echo) = parse_tools(&r.tools, allow_extra)?;
    let (choice, choice_echo) = parse_tool_choice(&r.tool_choice, &offered)?;
    let (grammar, text_echo) = parse_text(&r.text, allow_extra)?;
    if r.max_output_tokens == Some(0) {
        return Err(field("max_output_tokens", "max_output_tokens must be at least 1".into()));
    }
    let stream = r.stream.unwrap_or(false);
    let sampling = openai::Sampling { temperature: r.temperature, top_p: r.top_p, seed: r.seed, stream, user: r.user.clone(), ..Default::default() };
    let messages = chat_messages(r.instructions.as_deref(), &turns);
    let ask = ChatAsk {
        messages: &messages,
        messages_param: "input",
        offered,
        choice,
        parallel_tool_calls: r.parallel_tool_calls,
        grammar,
        limit: r.max_output_tokens,
        sampling: &sampling,
        logprobs: None,
        tools_param: |i| format!("tools[{i}].parameters"),
        continue_final: false,
        separate_reasoning: true,
    };
    let job = prepare_chat(st, ask)?;
    let frame = Arc::new(Frame {
        id: id.to_string(),
        created_at: now_secs(),
        model: st.info.name.clone(),
        instructions: r.instructions.clone(),
        max_output_tokens: r.max_output_tokens,
        parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
        previous_response_id: r.previous_response_id.clone(),
        temperature: job.params.sampling.temperature,
        top_p: job.params.sampling.top_p,
        text: text_echo,
        tool_choice: choice_echo,
        tools: tools_echo,
        metadata: r.metadata.clone().map_or(json!({}), Value::Object),
        user: r.user.clone(),
    });
    let guard = st.admit()?;
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let (admitted_tx, admitted) = tokio::sync::oneshot::channel();
    st.send(Job::Generate { prompt: job.prompt, params: job.params, arrived: Instant::now(), updates: tx, grammar_field: job.grammar_field, admitted: Some(admitted_tx) })?;
    // The engine builds the grammar when it takes the request: a grammar it
    // cannot build is a 400 here, before a stream has begun.
    if admitted.await.is_err() {
        return Err(match rx.recv().await {
            Some(Update::Failed(e)) => e,
            _ => ApiError::internal("the engine's thread ended"),
        });
    }
    let store = r.store.unwrap_or(true).then_some(turns);
    let mut running = Running { st: st.clone(), rx, builder: Builder::new(frame, job.think, job.tools), store, started, _guard: guard };
    if !stream {
        loop {
            if let Some(done) = running.step().await {
                return done.map(|v| Json(v).into_response());
            }
        }
    }
    Ok(sse(running))
}

/// The response's events as server-sent events (`event:` the type, `data:`
/// the event), ending with the response's last event; no `[DONE]`, as OpenAI's.
fn sse(running: Running) -> Response {
    let event = |v: Value| SseEvent::default().event(v["type"].as_str().unwrap_or("message")).data(v.to_string());
    struct S {
        running: Running,
        queue: VecDeque<SseEvent>,
        done: bool,
    }
    let mut first = S { queue: VecDeque::new(), done: false, running };
    first.queue.extend(first.running.builder.take_events().into_iter().map(event));
    let stream = futures_util::stream::unfold(first, move |mut s| async move {
        loop {
            if let Some(e) = s.queue.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(e), s));
            }
            if s.done {
                return None;
            }
            if let Some(end) = s.running.step().await {
                s.done = true;
                if let Err(e) = end {
                    // Headers are sent: the error goes in the stream, as OpenAI's.
                    log_request(&s.running.builder.frame.id, ENDPOINT, e.status, None, s.running.started, None);
                    s.running.builder.fail(&e);
                }
            }
            s.queue.extend(s.running.builder.take_events().into_iter().map(event));
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Refuses query parameters on `GET` / `DELETE /v1/responses/{id}` (OpenAI's
/// `include`, `stream`, `starting_after` replay what maxrun does not keep).
fn no_query(uri: &Uri) -> Result<(), ApiError> {
    match uri.query().and_then(|q| q.split('&').find(|p| !p.is_empty())) {
        Some(p) => {
            let name = p.split('=').next().unwrap_or(p);
            Err(field(name, format!("`{name}` is not supported here: a stored response is returned whole, its events are not kept")))
        }
        None => Ok(()),
    }
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn retrieve(State(st): St, headers: HeaderMap, uri: Uri, Path(id): Path<String>) -> Response {
    let started = Instant::now();
    let result = (|| {
        st.authorize(&headers)?;
        no_query(&uri)?;
        let stored = st.responses.lock().expect("never poisoned").get(&id).ok_or_else(|| ApiError::response_not_found(&id, None))?;
        log_request(&id, "GET /v1/responses", 200, None, started, None);
        Ok(Json(stored.response.clone()).into_response())
    })();
    respond(&st, "GET /v1/responses", &id, started, result)
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
pub async fn delete(State(st): St, headers: HeaderMap, uri: Uri, Path(id): Path<String>) -> Response {
    let started = Instant::now();
    let result = (|| {
        st.authorize(&headers)?;
        no_query(&uri)?;
        if !st.responses.lock().expect("never poisoned").remove(&id) {
            return Err(ApiError::response_not_found(&id, None));
        }
        log_request(&id, "DELETE /v1/responses", 200, None, started, None);
        Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
    })();
    respond(&st, "DELETE /v1/responses", &id, started, result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use maxrun_engine::constrain::tools::ToolFormat;

    fn frame() -> Arc<Frame> {
        Arc::new(Frame {
            id: "resp_test".into(),
            created_at: 1,
            model: "m".into(),
            instructions: None,
            max_output_tokens: None,
            parallel_tool_calls: true,
            previous_response_id: None,
            temperature: 1.0,
            top_p: 1.0,
            text: json!({"format": {"type": "text"}}),
            tool_choice: json!("auto"),
            tools: vec![],
            metadata: json!({}),
            user: None,
        })
    }

    fn usage() -> Usage {
        Usage { prompt_tokens: 5, completion_tokens: 3, ..Default::default() }
    }

    /// Builds a reply from `pieces` and returns its events and response.
    fn build(pieces: &[&str], think: Option<bool>, tools: Option<ToolReply>, reason: FinishReason) -> (Vec<Value>, Value) {
        let mut b = Builder::new(frame(), think, tools);
        for p in pieces {
            b.push(p);
        }
        let (response, _) = b.finish(reason, "", &usage());
        (b.take_events(), response)
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn text_comes_as_one_message_in_openais_event_order() {
        let (events, response) = build(&["Hello", ",", " world"], None, None, FinishReason::Stop);
        assert_eq!(
            types(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        assert!(events.iter().enumerate().all(|(i, e)| e["sequence_number"] == json!(i)), "numbered in order");
        let deltas: String = events.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
        assert_eq!(deltas, "Hello, world");
        assert_eq!(response["output"][0]["content"][0]["text"], "Hello, world");
        assert_eq!((response["status"].as_str(), response["usage"]["total_tokens"].as_u64()), (Some("completed"), Some(8)));
        assert_eq!(events.last().unwrap()["response"], response, "the last event carries the response");
        let (events, response) = build(&["Cut"], None, None, FinishReason::Length);
        assert_eq!(types(&events).last(), Some(&"response.incomplete"));
        assert_eq!((response["status"].as_str(), response["incomplete_details"]["reason"].as_str()), (Some("incomplete"), Some("max_output_tokens")));
        assert_eq!(response["output"][0]["status"], "incomplete");
    }

    #[test]
    fn thinking_is_a_reasoning_item_and_calls_are_function_call_items() {
        let forced = ToolReply { format: ToolFormat::Hermes, forced: true, named: true, max_calls: Some(1) };
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let pieces: Vec<String> = call.chars().map(String::from).collect();
        let pieces: Vec<&str> = std::iter::once("<think>hm</think>").chain(pieces.iter().map(String::as_str)).collect();
        let (events, response) = build(&pieces, Some(false), Some(forced), FinishReason::Stop);
        let output = response["output"].as_array().unwrap();
        assert_eq!(output.iter().map(|i| i["type"].as_str().unwrap()).collect::<Vec<_>>(), ["reasoning", "function_call"]);
        assert_eq!(output[0]["content"][0]["text"], "hm");
        assert_eq!((output[1]["name"].as_str(), output[1]["status"].as_str()), (Some("get_weather"), Some("completed")));
        assert_eq!(serde_json::from_str::<Value>(output[1]["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Paris"}));
        assert!(output[1]["call_id"].as_str().unwrap().starts_with("call_") && output[1]["id"].as_str().unwrap().starts_with("fc_"));
        let args: String = events.iter().filter(|e| e["type"] == "response.function_call_arguments.delta").map(|e| e["delta"].as_str().unwrap()).collect();
        assert_eq!(args, output[1]["arguments"].as_str().unwrap());
        assert!(events.iter().filter(|e| e["type"] == "response.function_call_arguments.delta").count() > 1, "the arguments streamed in pieces");
        let t = types(&events);
        let at = |name: &str| t.iter().position(|x| *x == name).unwrap();
        assert!(at("response.reasoning_text.delta") < at("response.output_item.done") && at("response.function_call_arguments.done") < at("response.completed"));
        // Text, then a call the model chose (auto): a message, then the call.
        let auto = ToolReply { format: ToolFormat::Hermes, forced: false, named: false, max_calls: None };
        let (_, response) = build(&["Let me check.\n", call], None, Some(auto), FinishReason::Stop);
        let kinds: Vec<&str> = response["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["message", "function_call"]);
        assert_eq!(response["output"][0]["content"][0]["text"].as_str().map(str::trim), Some("Let me check."));
    }

    #[test]
    fn input_items_become_chat_messages() {
        let input = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        ]);
        let turns = parse_input(&input, &[], false).unwrap();
        let m = chat_messages(Some("Be brief."), &turns);
        assert_eq!(m.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), ["system", "user", "assistant", "tool"]);
        assert_eq!(m[2].content, Some(json!("Checking.")));
        assert_eq!(m[2].tool_calls.as_ref().unwrap()[0]["function"]["name"], "get_weather");
        assert_eq!((m[3].tool_call_id.as_deref(), m[3].name.as_deref()), (Some("c1"), Some("get_weather")));
        assert_eq!(parse_input(&json!("hi"), &[], false).unwrap(), vec![Turn::Message { role: "user".into(), text: "hi".into() }]);
        for (bad, param) in [
            (json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
            (json!([{"role": "robot", "content": "x"}]), "input[0].role"),
            (json!([{"type": "function_call_output", "call_id": "nope", "output": "x"}]), "input[0].call_id"),
            (json!([{"type": "web_search_call", "id": "x"}]), "input[0].type"),
            (json!([{"type": "item_reference", "id": "x"}]), "input[0].type"),
            (json!([{"role": "user", "content": "x", "colour": 1}]), "input[0].colour"),
            (json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]), "input[0].arguments"),
            (json!(5), "input"),
        ] {
            assert_eq!(parse_input(&bad, &[], false).unwrap_err().param.as_deref(), Some(param), "{bad}");
        }
    }

    #[test]
    fn tools_choices_and_formats_are_honoured_or_refused_by_name() {
        let tools = Some(vec![json!({"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": true})]);
        let (offered, echo) = parse_tools(&tools, false).unwrap();
        assert_eq!((offered[0].name.as_str(), echo[0]["strict"].as_bool()), ("f", Some(true)));
        for (bad, param) in [
            (json!({"type": "web_search"}), "tools[0].type"),
            (json!({"type": "function", "name": "bad name"}), "tools[0].name"),
            (json!({"type": "function", "name": "f", "parameters": 3}), "tools[0].parameters"),
            (json!({"type": "function", "name": "f", "defer_loading": true}), "tools[0].defer_loading"),
        ] {
            assert_eq!(parse_tools(&Some(vec![bad.clone()]), false).unwrap_err().param.as_deref(), Some(param), "{bad}");
        }
        assert_eq!(parse_tool_choice(&Some(json!({"type": "function", "name": "f"})), &offered).unwrap().0, ToolChoice::Named("f".into()));
        assert_eq!(parse_tool_choice(&None, &offered).unwrap().0, ToolChoice::Auto);
        for bad in [json!({"type": "function", "name": "g"}), json!({"type": "file_search"}), json!("sometimes")] {
            assert_eq!(parse_tool_choice(&Some(bad), &offered).unwrap_err().param.as_deref(), Some("tool_choice"));
        }
        let (g, _) = parse_text(&Some(json!({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {}}}, "strict": true}})), false).unwrap();
        assert!(matches!(g, Some(("text.format", Grammar::JsonSchema(_)))));
        let e = parse_text(&Some(json!({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}})), false).unwrap_err();
        assert!(e.param.as_deref() == Some("text.format") && e.message.contains("text.format.schema") && e.message.contains("required"), "{e:?}");
        assert_eq!(parse_text(&Some(json!({"format": {"type": "xml"}})), false).unwrap_err().param.as_deref(), Some("text.format.type"));
        assert_eq!(parse_text(&Some(json!({"verbosity": "low"})), false).unwrap_err().param.as_deref(), Some("text.verbosity"));
    }

    #[test]
    fn ids_are_unique_and_prefixed() {
        let a = new_id("resp");
        assert!(a.starts_with("resp_") && a.len() == 5 + 32, "{a}");
        assert_ne!(a, new_id("resp"));
    }
}
