//! The OpenAI API's request and response shapes for completions, chat
//! completions, embeddings and models, and the checks that turn a request into
//! the engine's [`GenerationParams`]: every field is either honoured or refused
//! with a 400 naming it, never silently ignored.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::errors::ApiError;
use maxrun_engine::constrain::Grammar;
use maxrun_engine::GenerationParams;
use maxrun_runtime::format::GenerationDefaults;
use maxrun_runtime::sampler::SamplingParams;

/// A prompt as OpenAI accepts it: a string, token ids, or a list of one of either.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    pub max_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// SGLang's name for `include_stop_str_in_output` (sglang-router sends it
    /// with every request).
    #[serde(default)]
    pub no_stop_trim: bool,
    /// vLLM's: the stop string that ended the reply stays at its end.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// vLLM's and SGLang's (their default true; maxrun's default false: the
    /// reply's text holds every token it generated, as `maxrun --prompt` prints).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: spaces between special tokens' text in a slow tokenizer's
    /// decode; a `tokenizer.json` (fast) tokenizer decodes the same either way,
    /// in vLLM and here.
    pub spaces_between_special_tokens: Option<bool>,
    /// SGLang's: the model's hidden states in the reply; false only.
    pub return_hidden_states: Option<bool>,
}

/// The fields of [`Sampling`].
const SAMPLING_FIELDS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stream",
    "stream_options",
    "user",
    "no_stop_trim",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "return_hidden_states",
];

/// Every field a completion request may have.
pub const COMPLETION_FIELDS: &[&str] =
    &["model", "prompt", "logprobs", "echo", "best_of", "logit_bias", "suffix", "response_format", "add_special_tokens", "guided_json", "guided_regex", "guided_grammar"];
/// Every field a chat request may have.
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "continue_final_message",
    "separate_reasoning",
    "stream_reasoning",
];
/// Every field a `/tokenize` request may have (vLLM's names).
pub const TOKENIZE_FIELDS: &[&str] = &["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs", "tools"];
/// Every field a `/detokenize` request may have.
pub const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];
/// Every field an embedding request may have.
pub const EMBEDDING_FIELDS: &[&str] = &["model", "input", "encoding_format", "dimensions", "user"];

/// `POST /v1/completions` (its sampling fields apart: [`parse`]).
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Log-probabilities of the chosen token and this many alternatives (0-5).
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: bool,
    pub best_of: Option<u64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub suffix: Option<String>,
    pub response_format: Option<ResponseFormat>,
    /// Text prompts get the special tokens the tokenizer's post-processor adds
    /// (a BOS), as `transformers` and llama-server do; `false` turns that off
    /// (vLLM's field of the same name).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    #[serde(flatten)]
    pub guided: Guided,
}

fn yes() -> bool {
    true
}

/// One chat message. `content` may be a string or a list of text parts.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    pub name: Option<String>,
    /// An assistant message's calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message answers this call.
    pub tool_call_id: Option<String>,
}

/// One offered tool (`{"type": "function", "function": {...}}`).
#[derive(Clone, Debug, Deserialize)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

#[derive(Clone, Debug, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// Whether and how the reply must call a tool.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The offered tools, checked.
pub fn tools(specs: &Option<Vec<ToolSpec>>) -> Result<Vec<maxrun_engine::constrain::tools::Tool>, ApiError> {
    let mut out: Vec<maxrun_engine::constrain::tools::Tool> = Vec::new();
    for (i, t) in specs.iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        if t.kind != "function" {
            return Err(field(&format!("{at}.type"), format!("tool type `{}` is not supported; use function", t.kind)));
        }
        let tool = function_tool(&out, &format!("{at}.function"), &t.function.name, t.function.description.clone(), t.function.parameters.clone())?;
        out.push(tool);
    }
    Ok(out)
}

/// One offered function, checked against those before it (`earlier`): a name
/// of letters, digits, `_` and `-` that no other tool has, and parameters that
/// are a schema object (none: no arguments). `at` is the field that holds the
/// function's own fields (`tools[i].function` in Chat Completions, `tools[i]`
/// in the Responses API).
pub fn function_tool(earlier: &[maxrun_engine::constrain::tools::Tool], at: &str, name: &str, description: Option<String>, parameters: Option<Value>) -> Result<maxrun_engine::constrain::tools::Tool, ApiError> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        return Err(field(&format!("{at}.name"), format!("`{name}`: a function name is letters, digits, `_` and `-`")));
    }
    if earlier.iter().any(|o| o.name == name) {
        return Err(field(&format!("{at}.name"), format!("two tools are named `{name}`")));
    }
    let parameters = parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
    if !parameters.is_object() {
        return Err(field(&format!("{at}.parameters"), "parameters must be a JSON schema object".into()));
    }
    Ok(maxrun_engine::constrain::tools::Tool { name: name.to_string(), description, parameters })
}

/// `tool_choice`: `none`, `auto` (the default with tools), `required`, or a named function.
pub fn tool_choice(choice: &Option<Value>, tools: &[maxrun_engine::constrain::tools::Tool]) -> Result<ToolChoice, ApiError> {
    let parsed = match choice {
        None => {
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
            other => return Err(field("tool_choice", format!("`{other}`: use none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        },
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => ToolChoice::Named(name.to_string()),
            _ => return Err(field("tool_choice", format!("{v} is not a tool choice"))),
        },
    };
    match &parsed {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(field("tool_choice", "a tool is required but the request offers no tools".into())),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(field("tool_choice", format!("`{n}` is not one of the offered tools"))),
        _ => Ok(parsed),
    }
}

/// `POST /v1/chat/completions` (its sampling fields apart: [`parse`]).
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub guided: Guided,
    pub tools: Option<Vec<ToolSpec>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's and SGLang's: the reply continues the last (assistant) message
    /// instead of starting a new one.
    #[serde(default)]
    pub continue_final_message: bool,
    /// SGLang's: with a reasoning parser, the thinking goes to
    /// `reasoning_content` (true, the default) or stays in `content`.
    pub separate_reasoning: Option<bool>,
    /// SGLang's: streamed thinking comes as it is generated (true, the
    /// default) or in one `reasoning_content` delta once it ends.
    pub stream_reasoning: Option<bool>,
}

/// `POST /tokenize`, as vLLM takes it: a text `prompt`, or chat `messages`
/// through the chat template.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    /// The special tokens the tokenizer's post-processor adds (a BOS): by
    /// default with a prompt (as completions tokenize it) and not with messages
    /// (the template writes its own), as vLLM has it.
    pub add_special_tokens: Option<bool>,
    /// Messages end with the template's generation prompt (default true).
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's string (the vocabulary's, e.g. `Ġworld`).
    #[serde(default)]
    pub return_token_strs: bool,
    /// Tools rendered with the messages, as a chat request with them renders its prompt.
    pub tools: Option<Vec<ToolSpec>>,
}

impl TokenizeRequest {
    /// Refuses a request that is neither or both kinds, or mixes their fields.
    pub fn check(&self) -> Result<(), ApiError> {
        match (&self.prompt, &self.messages) {
            (Some(_), Some(_)) => Err(field("messages", "send either `prompt` (text) or `messages` (a chat through the template), not both".into())),
            (None, None) => Err(field("prompt", "send `prompt` (text to tokenize) or `messages` (a chat through the template)".into())),
            (Some(_), None) if self.add_generation_prompt.is_some() => Err(field("add_generation_prompt", "add_generation_prompt goes with `messages`, not `prompt`".into())),
            (Some(_), None) if self.tools.is_some() => Err(field("tools", "tools go with `messages`, not `prompt`".into())),
            (None, Some(m)) if m.is_empty() => Err(field("messages", "messages is empty; send at least one message".into())),
            _ => Ok(()),
        }
    }
}

/// `POST /detokenize`: token ids back to text.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// `POST /v1/embeddings`.
#[derive(Clone, Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Prompt,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u64>,
    pub user: Option<String>,
}

/// Fields OpenAI clients send that maxrun does not implement yet, and why not.
const NOT_YET: &[(&str, &str)] = &[
    ("functions", "the deprecated `functions` is not supported; send `tools`"),
    ("function_call", "the deprecated `function_call` is not supported; send `tool_choice`"),
];

/// Parses a JSON object body whose fields are among `fields` (plus the shared
/// sampling fields when `sampling`), naming the first field that is not, or that
/// does not fit its type. The sampling fields come back apart (default when not
/// `sampling`).
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8], fields: &[&str], sampling: bool) -> Result<(T, Sampling), ApiError> {
    parse_allowing(body, fields, sampling, false)
}

/// [`parse`]; with `allow_extra`, fields it does not know are dropped instead
/// of refused (`maxrun serve --allow-extra-request-fields`, for clients that
/// send their own extensions).
pub fn parse_allowing<T: for<'de> Deserialize<'de>>(body: &[u8], fields: &[&str], sampling: bool, allow_extra: bool) -> Result<(T, Sampling), ApiError> {
    parse_refusing(body, fields, sampling, allow_extra, NOT_YET)
}

/// [`parse_allowing`], refusing the fields of `not_yet` (field, why) by name
/// even with `allow_extra`: fields a client may send that maxrun knows and
/// cannot honour, which must never be dropped silently.
pub fn parse_refusing<T: for<'de> Deserialize<'de>>(body: &[u8], fields: &[&str], sampling: bool, allow_extra: bool, not_yet: &[(&str, &str)]) -> Result<(T, Sampling), ApiError> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::invalid("the request body is not UTF-8 text", None))?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid("the request body is empty; send a JSON object", None));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    };
    let known = |key: &str| fields.contains(&key) || (sampling && SAMPLING_FIELDS.contains(&key));
    for key in map.keys() {
        if let Some((_, why)) = not_yet.iter().find(|(k, _)| k == key) {
            return Err(field(key, format!("`{key}`: {why}")));
        }
        if !known(key) && !allow_extra {
            return Err(field(
                key,
                format!("unknown field `{key}`; see docs/serving.md for the fields maxrun serve takes (--allow-extra-request-fields drops unknown fields instead)"),
            ));
        }
    }
    map.retain(|k, _| known(k));
    let (sampled, own): (serde_json::Map<String, Value>, serde_json::Map<String, Value>) = map.into_iter().partition(|(k, _)| sampling && SAMPLING_FIELDS.contains(&k.as_str()));
    Ok((typed(own)?, typed(sampled)?))
}

/// Deserializes an object, naming the field at fault.
fn typed<T: for<'de> Deserialize<'de>>(map: serde_json::Map<String, Value>) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        let message = e.into_inner().to_string();
        // "missing field `x`" names the field itself.
        let param = param.or_else(|| message.split('`').nth(1).filter(|_| message.contains("field `")).map(str::to_string));
        ApiError::invalid(format!("the request does not fit the API: {message}"), param)
    })
}

pub(super) fn field(name: &str, message: String) -> ApiError {
    ApiError::invalid(message, Some(name.to_string()))
}

/// The stop strings of a request (at most 4, as OpenAI allows, none empty).
fn stops(stop: &Option<Stop>) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if list.len() > 4 {
        return Err(field("stop", format!("{} stop strings; at most 4 are allowed", list.len())));
    }
    if list.iter().any(String::is_empty) {
        return Err(field("stop", "a stop string is empty".into()));
    }
    Ok(list)
}

/// Choices one request may ask for (`n` times its prompts), as OpenAI's limit on `n`.
pub const MAX_CHOICES: usize = 128;

/// `n`: choices per prompt, 1 to [`MAX_CHOICES`].
pub fn choices(s: &Sampling) -> Result<usize, ApiError> {
    match s.n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => Ok(n as usize),
        Some(n) => Err(field("n", format!("n = {n}: ask for 1 to {MAX_CHOICES} choices"))),
    }
}

/// A seed for a request that sent none: sampled replies differ from request to
/// request, as OpenAI's and vLLM's do.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.finish()
}

/// Checks the shared fields and builds the generation parameters. `max_tokens`
/// is the request's limit (`None`: `default_max`); `logprobs` the alternatives
/// asked for; `scoring`: `max_tokens` 0 is allowed (echo scores the prompt).
pub fn generation_params(s: &Sampling, max_tokens: Option<u64>, default_max: usize, logprobs: Option<usize>, scoring: bool, defaults: &GenerationDefaults) -> Result<GenerationParams, ApiError> {
    let finite = |name: &str, v: Option<f32>, lo: f32, hi: f32| -> Result<(), ApiError> {
        match v {
            Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(field(name, format!("{x} is not between {lo} and {hi}"))),
            _ => Ok(()),
        }
    };
    finite("temperature", s.temperature, 0.0, 2.0)?;
    finite("top_p", s.top_p, 0.0, 1.0)?;
    finite("min_p", s.min_p, 0.0, 1.0)?;
    finite("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    finite("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    if let Some(r) = s.repetition_penalty {
        if !(r.is_finite() && r > 0.0) {
            return Err(field("repetition_penalty", format!("{r} must be a number above 0 (1 turns it off)")));
        }
    }
    let top_k = match s.top_k {
        None => defaults.top_k.unwrap_or(0),
        // vLLM's convention: -1 (like 0) keeps every token.
        Some(k) if k == -1 || k == 0 => 0,
        Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
        Some(k) => return Err(field("top_k", format!("{k} must be at least 1 (or 0 or -1 for no limit)"))),
    };
    let max_tokens = match max_tokens {
        None => default_max,
        Some(0) if scoring => 0,
        Some(0) => return Err(field("max_tokens", "max_tokens must be at least 1 (0 goes with echo = true, to score a prompt)".into())),
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
    };
    let seed = match s.seed {
        None => fresh_seed(),
        Some(x) => x as u64,
    };
    if s.stream_options.is_some() && !s.stream {
        return Err(field("stream_options", "stream_options goes with stream = true".into()));
    }
    if s.return_hidden_states == Some(true) {
        return Err(field("return_hidden_states", "maxrun serve does not return hidden states; send false or leave it out".into()));
    }
    let text = maxrun_engine::TextOptions { keep_stop: s.no_stop_trim || s.include_stop_str_in_output, skip_special_tokens: s.skip_special_tokens.unwrap_or(false) };
    let sampling = SamplingParams {
        // OpenAI's default temperature is 1; the artifact's generation config, where
        // it set one, is the model's own default (as vLLM takes it).
        temperature: s.temperature.or(defaults.temperature).unwrap_or(1.0),
        top_k,
        top_p: s.top_p.or(defaults.top_p).unwrap_or(1.0),
        min_p: s.min_p.or(defaults.min_p).unwrap_or(0.0),
    };
    Ok(GenerationParams {
        sampling,
        seed,
        max_tokens,
        stop: stops(&s.stop)?,
        ignore_eos: s.ignore_eos,
        repeat_penalty: s.repetition_penalty.or(defaults.repetition_penalty).filter(|&r| r != 1.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        logprobs,
        text,
        ..GenerationParams::default()
    })
}

/// `logit_bias`: token id (as a string key) -> a bias in [-100, 100] added to its logit.
pub fn logit_bias(map: &Option<serde_json::Map<String, Value>>, vocab: u64) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (k, v) in map.iter().flatten() {
        let id: u32 = k.parse().ok().filter(|&i: &u32| (i as u64) < vocab).ok_or_else(|| field("logit_bias", format!("`{k}` is not a token id below {vocab}")))?;
        let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| field("logit_bias", format!("the bias of token {k} must be a number from -100 to 100, not {v}")))?;
        out.push((id, bias as f32));
    }
    Ok(out)
}

/// `response_format` (OpenAI's structured output).
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub schema: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// The grammar a request asks for: `response_format`, or one of the extension
/// fields `guided_json` (a schema), `guided_regex`, `guided_grammar` (Lark), as
/// vLLM names them; at most one.
pub fn grammar(format: &Option<ResponseFormat>, guided: &Guided) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let mut asked: Vec<(&str, Grammar)> = Vec::new();
    match format {
        None | Some(ResponseFormat::Text) => {}
        Some(ResponseFormat::JsonObject) => asked.push(("response_format", Grammar::JsonObject)),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = json_schema.schema.clone().unwrap_or_else(|| serde_json::json!({"type": "object"}));
            if !schema.is_object() && schema != Value::Bool(true) {
                return Err(field("response_format", format!("json_schema.schema of `{}` must be a JSON schema object", json_schema.name)));
            }
            closable(&schema, "response_format", "json_schema.schema")?;
            asked.push(("response_format", Grammar::JsonSchema(schema)));
        }
    }
    if let Some(s) = &guided.guided_json {
        closable(s, "guided_json", "the schema")?;
        asked.push(("guided_json", Grammar::JsonSchema(s.clone())));
    }
    if let Some(r) = &guided.guided_regex {
        asked.push(("guided_regex", Grammar::Regex(r.clone())));
    }
    if let Some(g) = &guided.guided_grammar {
        asked.push(("guided_grammar", Grammar::Lark(g.clone())));
    }
    match asked.len() {
        0 => Ok(None),
        1 => Ok(asked.pop()),
        _ => Err(field(asked[1].0, format!("ask for one grammar: {} and {} both set one", asked[0].0, asked[1].0))),
    }
}

/// Refuses, as a 400 naming `param` and the keyword, a schema whose objects
/// cannot take only their declared properties (`constrain/schema.rs`): the
/// grammar is built on the engine's thread, and this names the field before.
fn closable(schema: &Value, param: &str, what: &str) -> Result<(), ApiError> {
    maxrun_engine::constrain::schema::close_objects(schema).map(drop).map_err(|e| field(param, format!("{what}: {e}")))
}

/// The grammar extension fields (docs/serving.md).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Guided {
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
}

/// Refuses the completion fields maxrun cannot honour.
pub fn check_completion_extras(r: &CompletionRequest) -> Result<(), ApiError> {
    if r.best_of.is_some_and(|b| b != 1) {
        return Err(field("best_of", "best_of above 1 is not supported".into()));
    }
    if r.suffix.is_some() {
        return Err(field("suffix", "suffix (insertion) is not supported".into()));
    }
    if r.logprobs.is_some_and(|n| n > 5) {
        return Err(field("logprobs", "logprobs is at most 5".into()));
    }
    Ok(())
}

/// Refuses the chat fields maxrun cannot honour; returns the alternatives asked for.
pub fn check_chat_extras(r: &ChatRequest) -> Result<Option<usize>, ApiError> {
    if r.messages.is_empty() {
        return Err(field("messages", "messages is empty; send at least one message".into()));
    }
    match (r.logprobs, r.top_logprobs) {
        (false, Some(_)) => Err(field("top_logprobs", "top_logprobs needs logprobs = true".into())),
        (_, Some(n)) if n > 20 => Err(field("top_logprobs", "top_logprobs is at most 20".into())),
        (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
        (false, None) => Ok(None),
    }
}

/// The text of a chat message's content: a string, or text parts joined.
pub fn message_text(m: &ChatMessage, index: usize) -> Result<String, ApiError> {
    let name = format!("messages[{index}].content");
    match &m.content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => return Err(field(&name, format!("a content part of type {} is not supported; send text", kind.unwrap_or("?")))),
                }
            }
            Ok(text)
        }
        Some(other) => Err(field(&name, format!("content must be a string or a list of text parts, not {other}"))),
    }
}

/// `usage` of a response.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Usage {
        Usage { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion }
    }
}

/// OpenAI's completion `logprobs` object for the given tokens (text and
/// log-probability; an echoed prompt's first token has none), `text_offset`
/// counted from `offset0`.
pub fn completion_logprobs(tokens: &[(String, Option<&maxrun_engine::TokenLogprob>)], tokenizer: &tokenizers::Tokenizer, offset0: usize) -> Value {
    let mut offset = offset0;
    let (mut texts, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (text, lp) in tokens {
        texts.push(json!(text));
        match lp {
            Some(lp) => {
                lps.push(json!(lp.logprob));
                let top: serde_json::Map<String, Value> = lp.top.iter().map(|(t, l)| (token_text(tokenizer, *t), json!(l))).collect();
                tops.push(Value::Object(top));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
        offsets.push(json!(offset));
        offset += text.len();
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// A token's own text (a piece of a word for subword tokenizers).
pub fn token_text(tokenizer: &tokenizers::Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// OpenAI's chat `logprobs.content` entries for the given tokens.
pub fn chat_logprobs(tokens: &[(String, maxrun_engine::TokenLogprob)], tokenizer: &tokenizers::Tokenizer) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|(text, lp)| {
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|(t, l)| {
                    let s = token_text(tokenizer, *t);
                    json!({"token": s, "logprob": l, "bytes": s.as_bytes()})
                })
                .collect();
            json!({"token": text, "logprob": lp.logprob, "bytes": text.as_bytes(), "top_logprobs": top})
        })
        .collect();
    json!({"content": content})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(v: Value) -> Result<GenerationParams, ApiError> {
        let s: Sampling = serde_json::from_value(v).unwrap();
        generation_params(&s, s.max_tokens, 16, None, false, &GenerationDefaults::default())
    }

    #[test]
    fn fields_are_honoured_or_refused_by_name() {
        let p = sampling(json!({"temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.1, "seed": 7, "stop": "\n", "max_tokens": 9, "presence_penalty": 1.0})).unwrap();
        assert_eq!(p.sampling, SamplingParams { temperature: 0.5, top_k: 40, top_p: 0.9, min_p: 0.1 });
        assert_eq!((p.seed, p.max_tokens, p.stop.clone(), p.presence_penalty), (7, 9, vec!["\n".to_string()], 1.0));
        assert_eq!(sampling(json!({})).unwrap().sampling.temperature, 1.0, "OpenAI's default temperature");
        assert_eq!(sampling(json!({"top_k": -1})).unwrap().sampling.top_k, 0);
        for (body, param) in [
            (json!({"temperature": 3.0}), "temperature"),
            (json!({"top_p": -0.1}), "top_p"),
            (json!({"top_k": -5}), "top_k"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": ""}), "stop"),
            (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
            (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
            (json!({"stream_options": {"include_usage": true}}), "stream_options"),
        ] {
            let e = sampling(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn n_is_between_1_and_the_limit_and_unseeded_requests_differ() {
        let n = |v: Value| choices(&serde_json::from_value::<Sampling>(v).unwrap());
        assert_eq!(n(json!({})).unwrap(), 1);
        assert_eq!(n(json!({"n": 128})).unwrap(), 128);
        for bad in [json!({"n": 0}), json!({"n": 129})] {
            assert_eq!(n(bad).unwrap_err().param.as_deref(), Some("n"));
        }
        let a = sampling(json!({})).unwrap().seed;
        let b = sampling(json!({})).unwrap().seed;
        assert_ne!(a, b, "two requests without a seed sample differently");
        let s: Sampling = serde_json::from_value(json!({"max_tokens": 0})).unwrap();
        assert_eq!(generation_params(&s, s.max_tokens, 16, Some(1), true, &GenerationDefaults::default()).unwrap().max_tokens, 0, "echo may score only");
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let parse_c = |b: &[u8]| parse::<CompletionRequest>(b, COMPLETION_FIELDS, true).map(|r| r.0);
        let e = parse_c(br#"{"prompt": "x", "temprature": 1}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temprature"), "{e:?}");
        let e = parse_c(br#"{"model": "m"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"), "{e:?}");
        let e = parse_c(b"{not json").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e:?}");
        let e = parse_c(br#"{"prompt": "x", "tools": []}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"), "{e:?}");
        let e = parse::<CompletionRequest>(br#"{"prompt": "x", "max_tokens": "many"}"#, COMPLETION_FIELDS, true).unwrap_err();
        assert!(e.message.contains("invalid type") && e.param.as_deref() == Some("max_tokens"), "{e:?}");
        let r: CompletionRequest = parse_c(br#"{"prompt": [1, 2, 3], "max_tokens": 4}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
    }

    #[test]
    fn schemas_that_cannot_be_closed_are_refused_naming_the_field_and_keyword() {
        let format: Option<ResponseFormat> = serde_json::from_value(json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}})).unwrap();
        let e = grammar(&format, &Guided::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("`required` at #") && e.message.contains("additionalProperties"), "{e:?}");
        let guided = Guided { guided_json: Some(json!({"properties": {"c": {"properties": {}, "minProperties": 1}}})), ..Guided::default() };
        let e = grammar(&None, &guided).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_json"));
        assert!(e.message.contains("`minProperties` at #/properties/c"), "{e:?}");
        // The grammar keeps the schema as sent; the engine closes it when it builds the grammar.
        let ok: Option<ResponseFormat> = serde_json::from_value(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {}}}}})).unwrap();
        assert_eq!(grammar(&ok, &Guided::default()).unwrap(), Some(("response_format", Grammar::JsonSchema(json!({"properties": {"a": {}}})))));
    }

    #[test]
    fn tokenize_takes_a_prompt_or_messages() {
        let check = |v: Value| parse::<TokenizeRequest>(v.to_string().as_bytes(), TOKENIZE_FIELDS, false).and_then(|(r, _)| r.check());
        assert!(check(json!({"prompt": "hi"})).is_ok());
        assert!(check(json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false, "return_token_strs": true})).is_ok());
        for (body, param) in [
            (json!({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}), "messages"),
            (json!({}), "prompt"),
            (json!({"prompt": "hi", "add_generation_prompt": true}), "add_generation_prompt"),
            (json!({"messages": []}), "messages"),
            (json!({"prompt": "hi", "content": "llama-server's name"}), "content"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
        ] {
            assert_eq!(check(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
        let e = parse::<DetokenizeRequest>(br#"{"tokens": [1, -2]}"#, DETOKENIZE_FIELDS, false).unwrap_err();
        assert!(e.param.as_deref().is_some_and(|p| p.starts_with("tokens")), "{e:?}");
    }

    #[test]
    fn chat_content_may_be_text_parts() {
        let m: ChatMessage = serde_json::from_value(json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})).unwrap();
        assert_eq!(message_text(&m, 0).unwrap(), "ab");
        let m: ChatMessage = serde_json::from_value(json!({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})).unwrap();
        assert_eq!(message_text(&m, 3).unwrap_err().param.as_deref(), Some("messages[3].content"));
    }
}
