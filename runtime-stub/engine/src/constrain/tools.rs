//! Tool calls: how each model family writes them, how to read them back out of a
//! reply, and the grammar that makes a reply one (`tool_choice: "required"` or a
//! named function).
//!
//! | format | a call looks like | families |
//! |---|---|---|
//! | `hermes` | `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` | Qwen 2.5 / 3, Hermes, SmolLM, and templates without tool support (maxrun then describes the tools in a system message, as Qwen's template does) |
//! | `llama3` | `{"name": ..., "parameters": {...}}` (after `<\|python_tag\|>` where the template uses it) | Llama 3.1 / 3.2 / 3.3 |
//! | `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` | Mistral |
//! | `harmony` | `<\|channel\|>commentary to=functions.NAME <\|constrain\|>json<\|message\|>{...}<\|call\|>` | gpt-oss (`harmony.rs`) |
//!
//! The format follows the artifact's chat template (the marker it mentions) or
//! `maxrun serve --tool-parser`.

use serde_json::{json, Value};

use super::harmony::{self, Route};
use super::schema::{close_objects, SchemaError};
use super::Grammar;

/// How a model family writes its tool calls.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
    /// gpt-oss: a message to `functions.NAME` whose body is the arguments.
    Harmony,
}

impl ToolFormat {
    pub fn parse(name: &str) -> Result<ToolFormat, String> {
        match name {
            "hermes" => Ok(ToolFormat::Hermes),
            "llama3" => Ok(ToolFormat::Llama3),
            "mistral" => Ok(ToolFormat::Mistral),
            "harmony" => Ok(ToolFormat::Harmony),
            other => Err(format!("`{other}` is not a tool-call format; formats: hermes, llama3, mistral, harmony")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Harmony => "harmony",
        }
    }

    /// The format a chat template writes, from the markers it mentions; Hermes
    /// (also what maxrun asks for of templates without tool support) otherwise.
    pub fn of_template(template: &str) -> ToolFormat {
        if template.contains("<|channel|>") {
            ToolFormat::Harmony
        } else if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// The key of a call's arguments in this format.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }
}

/// One function a request offers (OpenAI's `tools[i].function`).
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object.
    pub parameters: Value,
}

/// A call read out of a reply.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON value (OpenAI sends them as a string of it).
    pub arguments: Value,
}

/// What a reply holds: text for the user, and the calls it made.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// A call object `{"name": ..., <arguments key>: {...}}`, if `v` is one.
fn call_of(v: &Value, format: ToolFormat) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = v.get(format.arguments_key()).or_else(|| v.get("arguments")).or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
    // Some models write the arguments as a JSON string.
    let arguments = match arguments {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        other => other,
    };
    Some(ToolCall { name, arguments })
}

/// Every JSON value in `text` one after another (separated by whitespace or `;`).
fn json_values(text: &str) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = stream.next()?.ok()?;
        out.push(v);
        rest = rest[stream.byte_offset()..].trim_start().trim_start_matches(';').trim_start();
    }
    Some(out)
}

/// Reads the tool calls out of a finished reply. Text that is not a well-formed
/// call stays content.
pub fn parse(reply: &str, format: ToolFormat) -> Parsed {
    match format {
        ToolFormat::Hermes => {
            let (mut content, mut calls) = (String::new(), Vec::new());
            let mut rest = reply;
            while let Some(start) = rest.find("<tool_call>") {
                let body_start = start + "<tool_call>".len();
                let Some(len) = rest[body_start..].find("</tool_call>") else { break };
                let body = &rest[body_start..body_start + len];
                match serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| call_of(&v, format)) {
                    Some(call) => {
                        content.push_str(&rest[..start]);
                        calls.push(call);
                    }
                    None => content.push_str(&rest[..body_start + len + "</tool_call>".len()]),
                }
                rest = &rest[body_start + len + "</tool_call>".len()..];
            }
            content.push_str(rest);
            Parsed { content: if calls.is_empty() { content } else { content.trim().to_string() }, calls }
        }
        ToolFormat::Mistral => match reply.find("[TOOL_CALLS]") {
            Some(at) => {
                let body = &reply[at + "[TOOL_CALLS]".len()..];
                let calls: Option<Vec<ToolCall>> = json_values(body).and_then(|vs| {
                    vs.iter().flat_map(|v| v.as_array().cloned().unwrap_or_else(|| vec![v.clone()])).map(|v| call_of(&v, format)).collect()
                });
                match calls {
                    Some(calls) if !calls.is_empty() => Parsed { content: reply[..at].trim().to_string(), calls },
                    _ => Parsed { content: reply.to_string(), calls: vec![] },
                }
            }
            None => Parsed { content: reply.to_string(), calls: vec![] },
        },
        ToolFormat::Harmony => {
            // Each message to a function whose body is JSON is a call; the rest
            // (text, other messages) stays content.
            let (mut content, mut calls, mut pos) = (String::new(), Vec::new(), 0);
            for m in harmony::messages(reply) {
                let Route::Call(name) = &m.route else { continue };
                let Ok(arguments) = serde_json::from_str::<Value>(m.body.trim()) else { continue };
                content.push_str(&reply[pos..m.span.start]);
                pos = m.span.end;
                calls.push(ToolCall { name: name.clone(), arguments });
            }
            content.push_str(&reply[pos..]);
            Parsed { content: if calls.is_empty() { content } else { content.trim().to_string() }, calls }
        }
        ToolFormat::Llama3 => {
            let body = reply.trim_start().strip_prefix("<|python_tag|>").unwrap_or(reply).trim();
            if !body.starts_with('{') {
                return Parsed { content: reply.to_string(), calls: vec![] };
            }
            let calls: Option<Vec<ToolCall>> = json_values(body).and_then(|vs| vs.iter().map(|v| call_of(v, format)).collect());
            match calls {
                Some(calls) if !calls.is_empty() => Parsed { content: String::new(), calls },
                _ => Parsed { content: reply.to_string(), calls: vec![] },
            }
        }
    }
}

/// The schema of one call to `tool` in `format`: its name, then its arguments
/// under the tool's parameters, whose objects take only their declared
/// properties as a response format's do (`schema.rs`).
fn call_schema(tool: &Tool, format: ToolFormat) -> Result<Value, SchemaError> {
    let mut properties = serde_json::Map::new();
    properties.insert("name".into(), json!({"const": tool.name}));
    properties.insert(format.arguments_key().into(), close_objects(&tool.parameters)?);
    Ok(json!({"type": "object", "properties": properties, "required": ["name", format.arguments_key()], "additionalProperties": false}))
}

/// The grammar of a reply that is calls to `tools` and nothing else, in
/// `format`: one call, or one or more when `parallel`. A tool whose parameters
/// cannot be honoured is the error, with its index in `tools`.
pub fn grammar(tools: &[Tool], format: ToolFormat, parallel: bool) -> Result<Grammar, (usize, SchemaError)> {
    if format == ToolFormat::Harmony {
        return harmony_grammar(tools);
    }
    let schemas: Vec<Value> = tools.iter().enumerate().map(|(i, t)| call_schema(t, format).map_err(|e| (i, e))).collect::<Result<_, _>>()?;
    let one = if schemas.len() == 1 { schemas.into_iter().next().expect("one") } else { json!({"anyOf": schemas}) };
    let layout = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let mut one = one;
    one.as_object_mut().expect("a schema object").insert("x-guidance".into(), layout.clone());
    let lark = match format {
        ToolFormat::Hermes => {
            let repeat = if parallel { "(\"\\n\" call)*" } else { "" };
            format!("start: call {repeat}\ncall: \"<tool_call>\\n\" call_json \"\\n</tool_call>\"\ncall_json: %json {one}\n")
        }
        ToolFormat::Llama3 => {
            let repeat = if parallel { "(\"; \" call)*" } else { "" };
            format!("start: call {repeat}\ncall: %json {one}\n")
        }
        ToolFormat::Mistral => {
            let max = if parallel { Value::Null } else { json!(1) };
            let mut array = json!({"type": "array", "items": one, "minItems": 1});
            if !max.is_null() {
                array["maxItems"] = max;
            }
            array.as_object_mut().expect("a schema object").insert("x-guidance".into(), layout);
            format!("start: \"[TOOL_CALLS]\" calls\ncalls: %json {array}\n")
        }
        ToolFormat::Harmony => unreachable!("harmony_grammar, above"),
    };
    Ok(Grammar::Lark(lark))
}

/// The harmony call grammar: one message to one of `tools`, its header
/// (`harmony::call_header`), arguments under the tool's parameters (compact
/// JSON), `<|call|>`. One call a reply: gpt-oss ends its turn at `<|call|>`
/// and writes the next call after the result.
fn harmony_grammar(tools: &[Tool]) -> Result<Grammar, (usize, SchemaError)> {
    let layout = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let mut rules = vec![format!("start: {}", (0..tools.len()).map(|i| format!("call{i}")).collect::<Vec<_>>().join(" | "))];
    for (i, t) in tools.iter().enumerate() {
        let mut schema = close_objects(&t.parameters).map_err(|e| (i, e))?;
        if let Some(o) = schema.as_object_mut() {
            o.insert("x-guidance".into(), layout.clone());
        }
        let header = serde_json::to_string(&harmony::call_header(&t.name)).expect("a string");
        rules.push(format!("call{i}: {header} args{i} \"<|call|>\"\nargs{i}: %json {schema}"));
    }
    Ok(Grammar::Lark(rules.join("\n") + "\n"))
}

/// A system message describing `tools` in the Hermes format, for chat templates
/// that take no `tools` (the words of Qwen 2.5's template).
pub fn hermes_system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        let f = json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}});
        s.push('\n');
        s.push_str(&f.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// How an assistant message's earlier calls are written back into a prompt for a
/// template that takes no `tool_calls` (Hermes).
pub fn hermes_calls_text(calls: &[ToolCall]) -> String {
    calls.iter().map(|c| format!("<tool_call>\n{}\n</tool_call>", json!({"name": c.name, "arguments": c.arguments}))).collect::<Vec<_>>().join("\n")
}

/// The marker that opens a call in `format` (Llama 3's calls open with `{`).
fn marker(format: ToolFormat) -> Option<&'static str> {
    match format {
        ToolFormat::Hermes => Some("<tool_call>"),
        ToolFormat::Mistral => Some("[TOOL_CALLS]"),
        // The reasoning splitter writes each call in `harmony::call_header`'s layout.
        ToolFormat::Harmony => Some("<|channel|>"),
        ToolFormat::Llama3 => None,
    }
}

/// One piece of a call, streamed as the call is generated.
#[derive(Clone, Debug, PartialEq)]
pub enum CallDelta {
    /// Call `index` begins: its function's name (sent with the call's id and type).
    Head { index: usize, name: String },
    /// More of call `index`'s arguments, as JSON text.
    Arguments { index: usize, text: String },
}

/// Where a [`CallScanner`] is in a reply.
#[derive(Debug)]
enum Scan {
    /// Looking for the next call from `pos`.
    Seeking,
    /// In call `calls - 1`'s arguments: scanned to `at`, sent to `sent`, at
    /// this depth of brackets, maybe inside a string.
    Arguments { at: usize, sent: usize, depth: usize, in_string: bool, escaped: bool },
    /// The reply is not in the call grammar's layout: the end's parse decides.
    Off,
}

/// Reads the calls out of a reply held to the call grammar while it grows. The
/// grammar writes each call as `{"name": "NAME", "KEY": ARGS}` (json.dumps'
/// separators, the name first, names of letters, digits, `_` and `-`), so a
/// call begins at `{"name": "` and its arguments are the JSON value after
/// `"KEY": `, followed to its end through its brackets and strings.
#[derive(Debug)]
struct CallScanner {
    key: &'static str,
    pos: usize,
    calls: usize,
    state: Scan,
}

impl CallScanner {
    fn new(format: ToolFormat) -> CallScanner {
        CallScanner { key: format.arguments_key(), pos: 0, calls: 0, state: Scan::Seeking }
    }

    /// The call pieces that `all` (the reply so far) adds to what was read before.
    fn scan(&mut self, all: &str) -> Vec<CallDelta> {
        const OPEN: &str = "{\"name\": \"";
        let mut out = Vec::new();
        loop {
            match &mut self.state {
                Scan::Off => return out,
                Scan::Seeking => {
                    let Some(found) = all[self.pos..].find(OPEN) else { return out };
                    let name_at = self.pos + found + OPEN.len();
                    let Some(name_len) = all[name_at..].find('"') else { return out };
                    let name = &all[name_at..name_at + name_len];
                    let separator = format!("\", \"{}\": ", self.key);
                    let rest = &all[name_at + name_len..];
                    if rest.len() < separator.len() {
                        if !separator.starts_with(rest) {
                            self.state = Scan::Off;
                        }
                        return out;
                    }
                    if !rest.starts_with(&separator) {
                        self.state = Scan::Off;
                        return out;
                    }
                    out.push(CallDelta::Head { index: self.calls, name: name.to_string() });
                    self.calls += 1;
                    let at = name_at + name_len + separator.len();
                    self.state = Scan::Arguments { at, sent: at, depth: 0, in_string: false, escaped: false };
                }
                Scan::Arguments { at, sent, depth, in_string, escaped } => {
                    let mut end = None;
                    for (i, ch) in all[*at..].char_indices() {
                        let i = *at + i;
                        if *in_string {
                            if *escaped {
                                *escaped = false;
                            } else if ch == '\\' {
                                *escaped = true;
                            } else if ch == '"' {
                                *in_string = false;
                                if *depth == 0 {
                                    end = Some(i + 1);
                                    break;
                                }
                            }
                            continue;
                        }
                        match ch {
                            '{' | '[' => *depth += 1,
                            '}' | ']' if *depth == 0 => {
                                // A number or literal ends where the call object closes.
                                end = Some(i);
                                break;
                            }
                            '}' | ']' => {
                                *depth -= 1;
                                if *depth == 0 {
                                    end = Some(i + 1);
                                    break;
                                }
                            }
                            ',' if *depth == 0 => {
                                end = Some(i);
                                break;
                            }
                            '"' => *in_string = true,
                            _ => {}
                        }
                    }
                    let upto = end.unwrap_or(all.len());
                    if upto > *sent {
                        out.push(CallDelta::Arguments { index: self.calls - 1, text: all[*sent..upto].to_string() });
                        *sent = upto;
                    }
                    match end {
                        Some(e) => {
                            self.pos = e;
                            self.state = Scan::Seeking;
                        }
                        None => {
                            *at = all.len();
                            return out;
                        }
                    }
                }
            }
        }
    }
}

/// A reply's text streamed while it is content: from the first place a call
/// may begin, text is held back, and at the end the whole reply is parsed. A
/// reply held to the call grammar (`tool_choice` required or named) streams
/// its calls as they are generated instead: each call's name, then its
/// arguments piece by piece, as OpenAI streams them.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Everything is a call (`tool_choice` required or named): nothing streams as content.
    whole: bool,
    all: String,
    sent: usize,
    calling: bool,
    /// The calls streamed so far, for a reply held to the call grammar.
    scanner: Option<CallScanner>,
}

impl ToolStream {
    pub fn new(format: ToolFormat, whole: bool) -> ToolStream {
        ToolStream { format, whole, all: String::new(), sent: 0, calling: whole, scanner: whole.then(|| CallScanner::new(format)) }
    }

    /// Takes the next piece of the reply; returns the content to send now.
    pub fn push(&mut self, text: &str) -> String {
        self.all.push_str(text);
        if self.calling {
            return String::new();
        }
        let unsent = &self.all[self.sent..];
        let safe = match marker(self.format) {
            Some(m) => match unsent.find(m) {
                Some(at) => {
                    self.calling = true;
                    at
                }
                // Hold back what could be the start of the marker.
                None => unsent.len() - (1..m.len()).rev().find(|&n| unsent.len() >= n && unsent.is_char_boundary(unsent.len() - n) && m.starts_with(&unsent[unsent.len() - n..])).unwrap_or(0),
            },
            None => {
                let t = self.all.trim_start();
                if t.is_empty() || "<|python_tag|>".starts_with(t) {
                    0
                } else if t.starts_with('{') || t.starts_with("<|python_tag|>") {
                    self.calling = true;
                    0
                } else {
                    unsent.len()
                }
            }
        };
        let out = unsent[..safe].to_string();
        self.sent += safe;
        out
    }

    /// The call pieces the reply so far adds (a reply held to the call grammar
    /// only; others send their calls at the end).
    pub fn deltas(&mut self) -> Vec<CallDelta> {
        match &mut self.scanner {
            Some(s) => s.scan(&self.all),
            None => vec![],
        }
    }

    /// The end of the reply: its calls (at most `max_calls`), the content not
    /// sent yet, and the call pieces not sent yet.
    pub fn finish(&mut self, max_calls: Option<usize>) -> (Parsed, String, Vec<CallDelta>) {
        let mut parsed = parse(&self.all, self.format);
        if let Some(max) = max_calls {
            parsed.calls.truncate(max);
        }
        let mut deltas = self.deltas();
        let streamed = self.scanner.as_ref().map_or(0, |s| s.calls);
        // Calls the scanner did not follow (a reply in another layout, or every
        // call of a reply that was not held to the grammar) go whole.
        for (index, call) in parsed.calls.iter().enumerate().skip(streamed) {
            deltas.push(CallDelta::Head { index, name: call.name.clone() });
            deltas.push(CallDelta::Arguments { index, text: call.arguments.to_string() });
        }
        let sent = &self.all[..self.sent];
        let rest = if self.whole {
            // A forced call that did not parse (cut by the token limit) and
            // streamed nothing: the text.
            if parsed.calls.is_empty() && streamed == 0 {
                parsed.content.clone()
            } else {
                String::new()
            }
        } else {
            parsed.content.strip_prefix(sent.trim_end()).or_else(|| parsed.content.strip_prefix(sent)).map_or(String::new(), str::to_string)
        };
        (parsed, rest, deltas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool { name: "get_weather".into(), description: Some("Weather in a city".into()), parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}) }
    }

    /// Replies in each format as those models write them.
    #[test]
    fn recorded_replies_parse_into_calls() {
        // Qwen 2.5 (Hermes): text, then a call.
        let p = parse("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", ToolFormat::Hermes);
        assert_eq!(p.content, "Let me check.");
        assert_eq!(p.calls, vec![ToolCall { name: "get_weather".into(), arguments: json!({"city": "Paris"}) }]);
        // Two parallel calls.
        let p = parse("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call>", ToolFormat::Hermes);
        assert_eq!(p.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        // Llama 3.1: a JSON object with "parameters", possibly after <|python_tag|>.
        let p = parse("<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", ToolFormat::Llama3);
        assert_eq!(p.calls, vec![ToolCall { name: "get_weather".into(), arguments: json!({"city": "Oslo"}) }]);
        let p = parse("{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": \"v\"}}", ToolFormat::Llama3);
        assert_eq!(p.calls.len(), 2);
        // Mistral: [TOOL_CALLS] then an array.
        let p = parse("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]", ToolFormat::Mistral);
        assert_eq!(p.calls[0].arguments, json!({"city": "Rome"}));
        // Arguments written as a JSON string are read as the object.
        let p = parse("<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 2}\"}</tool_call>", ToolFormat::Hermes);
        assert_eq!(p.calls[0].arguments, json!({"x": 2}));
    }

    /// gpt-oss (harmony): a call as the reasoning splitter writes it into the
    /// content, and a raw reply (reasoning not split) whose other messages stay
    /// content; a call whose body is not JSON stays text. The grammar forces one
    /// call in the same layout, and streaming holds it back from its header.
    #[test]
    fn harmony_calls_parse_and_stream() {
        let split = format!("Checking. {}{{\"city\": \"Paris\"}}<|call|>", harmony::call_header("get_weather"));
        let p = parse(&split, ToolFormat::Harmony);
        assert_eq!((p.content.as_str(), p.calls.clone()), ("Checking.", vec![ToolCall { name: "get_weather".into(), arguments: json!({"city": "Paris"}) }]));
        let raw = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>";
        let p = parse(raw, ToolFormat::Harmony);
        assert_eq!(p.calls[0].arguments, json!({"city": "Oslo"}));
        assert_eq!(p.content, "<|channel|>analysis<|message|>hm<|end|>");
        let bad = format!("{}not json<|call|>", harmony::call_header("f"));
        assert!(parse(&bad, ToolFormat::Harmony).calls.is_empty());
        assert_eq!(ToolFormat::of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}"), ToolFormat::Harmony);
        let Ok(Grammar::Lark(g)) = grammar(&[weather()], ToolFormat::Harmony, true) else { panic!() };
        assert!(g.contains("to=functions.get_weather <|constrain|>json<|message|>") && g.contains("\"<|call|>\"") && g.contains("%json") && g.contains("\"additionalProperties\":false"), "{g}");
        let mut s = ToolStream::new(ToolFormat::Harmony, false);
        let mut streamed = String::new();
        for piece in split.as_bytes().chunks(3) {
            streamed.push_str(&s.push(std::str::from_utf8(piece).unwrap()));
        }
        let (parsed, rest, deltas) = s.finish(None);
        assert_eq!(parsed.calls.len(), 1);
        assert_eq!(deltas.len(), 2);
        assert_eq!((streamed + &rest).trim_end(), "Checking.");
    }

    #[test]
    fn text_that_is_not_a_call_stays_text() {
        for (reply, format) in [
            ("The weather is fine.", ToolFormat::Hermes),
            ("<tool_call>not json</tool_call>", ToolFormat::Hermes),
            ("<tool_call>{\"name\": \"a\"", ToolFormat::Hermes),
            ("{\"city\": \"Paris\"}", ToolFormat::Llama3),
            ("Sure: {\"name\": \"a\"}", ToolFormat::Llama3),
            ("[TOOL_CALLS] oops", ToolFormat::Mistral),
        ] {
            let p = parse(reply, format);
            assert!(p.calls.is_empty(), "{reply}: {p:?}");
            assert_eq!(p.content, reply);
        }
    }

    /// Streamed in pieces of every size, content before a call streams, the call
    /// is held back, and the end gives the same parse as the whole reply.
    #[test]
    fn streams_hold_back_calls() {
        for (reply, format, content) in [
            ("Checking.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>", ToolFormat::Hermes, "Checking.\n"),
            ("{\"name\": \"a\", \"parameters\": {}}", ToolFormat::Llama3, ""),
            ("Plain text with < and [ signs.", ToolFormat::Mistral, "Plain text with < and [ signs."),
        ] {
            for size in 1..reply.len() {
                let mut s = ToolStream::new(format, false);
                let mut streamed = String::new();
                let chars: Vec<char> = reply.chars().collect();
                for piece in chars.chunks(size) {
                    streamed.push_str(&s.push(&piece.iter().collect::<String>()));
                }
                assert!(s.deltas().is_empty(), "a reply not held to the grammar sends its calls at the end");
                let (parsed, rest, deltas) = s.finish(None);
                assert_eq!(parsed, parse(reply, format));
                assert_eq!(deltas.len(), 2 * parsed.calls.len(), "{deltas:?}");
                assert!(!streamed.contains("<tool_call>") && !streamed.contains('{'), "{streamed:?}");
                streamed.push_str(&rest);
                assert_eq!(streamed.trim_end(), content.trim_end(), "pieces of {size}: {reply:?}");
            }
        }
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(ToolFormat::of_template("{% if tools %}<tool_call>{% endif %}"), ToolFormat::Hermes);
        assert_eq!(ToolFormat::of_template("<|python_tag|>{{ x }}"), ToolFormat::Llama3);
        assert_eq!(ToolFormat::of_template("[TOOL_CALLS] {{ x }}"), ToolFormat::Mistral);
        assert_eq!(ToolFormat::of_template("{{ messages }}"), ToolFormat::Hermes);
        assert!(ToolFormat::parse("xml").is_err());
    }

    #[test]
    fn call_grammars_are_lark_with_the_tools_schemas() {
        let Ok(Grammar::Lark(g)) = grammar(&[weather()], ToolFormat::Hermes, false) else { panic!() };
        assert!(g.contains("<tool_call>") && g.contains("\"const\":\"get_weather\"") && g.contains("%json"), "{g}");
        assert!(!g.contains("call)*"), "one call only: {g}");
        // The parameters' objects take only their declared properties, as a response format's do.
        assert!(g.contains("\"required\":[\"city\"],\"additionalProperties\":false"), "{g}");
        let Ok(Grammar::Lark(g)) = grammar(&[weather()], ToolFormat::Hermes, true) else { panic!() };
        assert!(g.contains("(\"\\n\" call)*"), "one or more calls: {g}");
        let Ok(Grammar::Lark(g)) = grammar(&[weather(), Tool { name: "b".into(), description: None, parameters: json!({"type": "object"}) }], ToolFormat::Mistral, true) else { panic!() };
        assert!(g.contains("[TOOL_CALLS]") && g.contains("anyOf") && !g.contains("maxItems"), "{g}");
        let Ok(Grammar::Lark(g)) = grammar(&[weather()], ToolFormat::Mistral, false) else { panic!() };
        assert!(g.contains("\"maxItems\":1"), "{g}");
        // Parameters that cannot be honoured are refused, naming the tool by its index.
        let bad = Tool { name: "c".into(), description: None, parameters: json!({"type": "object", "properties": {}, "required": ["x"]}) };
        let (index, e) = grammar(&[weather(), bad], ToolFormat::Hermes, false).unwrap_err();
        assert_eq!((index, e.keyword), (1, "required"), "{e}");
    }

    /// The pieces of a reply's calls, joined per call: (name, arguments text).
    fn joined(deltas: &[CallDelta]) -> Vec<(String, String)> {
        let mut calls: Vec<(String, String)> = Vec::new();
        for d in deltas {
            match d {
                CallDelta::Head { index, name } => {
                    assert_eq!(*index, calls.len(), "heads in order: {deltas:?}");
                    calls.push((name.clone(), String::new()));
                }
                CallDelta::Arguments { index, text } => {
                    assert_eq!(*index + 1, calls.len(), "arguments follow their head: {deltas:?}");
                    calls[*index].1.push_str(text);
                }
            }
        }
        calls
    }

    /// A reply held to the call grammar, in pieces of every size: each call's
    /// head comes once its name is whole, its arguments as they come (the
    /// first piece before the reply ends), and the pieces join to the
    /// arguments as written; the end adds nothing, and no content is sent.
    #[test]
    fn forced_calls_stream_their_arguments_as_they_come() {
        let tricky = r#"{"q": "a } \" ] {", "n": [1, {"m": null}], "x": -2.5e3}"#;
        for (reply, format, calls) in [
            (
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>".to_string(),
                ToolFormat::Hermes,
                vec![("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)],
            ),
            (
                format!("<tool_call>\n{{\"name\": \"a\", \"arguments\": {tricky}}}\n</tool_call>\n<tool_call>\n{{\"name\": \"b-2\", \"arguments\": {{}}}}\n</tool_call>"),
                ToolFormat::Hermes,
                vec![("a", tricky), ("b-2", "{}")],
            ),
            (r#"{"name": "a", "parameters": {"k": "v"}}; {"name": "b", "parameters": 5}"#.to_string(), ToolFormat::Llama3, vec![("a", r#"{"k": "v"}"#), ("b", "5")]),
            (r#"[TOOL_CALLS][{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", "arguments": "s,}"}]"#.to_string(), ToolFormat::Mistral, vec![("a", r#"{"x": [1, 2]}"#), ("b", r#""s,}""#)]),
        ] {
            let chars: Vec<char> = reply.chars().collect();
            for size in 1..=chars.len() {
                let mut s = ToolStream::new(format, true);
                let mut deltas = Vec::new();
                for piece in chars.chunks(size) {
                    assert_eq!(s.push(&piece.iter().collect::<String>()), "", "nothing streams as content");
                    deltas.extend(s.deltas());
                }
                let (parsed, rest, last) = s.finish(None);
                assert!(last.is_empty() && rest.is_empty(), "the end adds nothing: {last:?} {rest:?}");
                assert_eq!(parsed.calls.len(), calls.len());
                let got = joined(&deltas);
                let want: Vec<(String, String)> = calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect();
                assert_eq!(got, want, "pieces of {size}: {reply}");
                for ((_, text), call) in got.iter().zip(&parsed.calls) {
                    assert_eq!(serde_json::from_str::<Value>(text).unwrap(), call.arguments);
                }
                if size == 1 {
                    assert!(deltas.len() > 2 * calls.len(), "arguments came in pieces: {deltas:?}");
                }
            }
        }
    }

    /// A forced call cut by the token limit keeps what it streamed; a reply in
    /// another layout is sent whole at the end; `max_calls` keeps the first.
    #[test]
    fn cut_calls_other_layouts_and_the_call_limit() {
        let mut s = ToolStream::new(ToolFormat::Hermes, true);
        s.push("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"city\": \"Par");
        assert_eq!(joined(&s.deltas()), vec![("a".to_string(), r#"{"city": "Par"#.to_string())]);
        let (parsed, rest, last) = s.finish(None);
        assert!(parsed.calls.is_empty() && rest.is_empty() && last.is_empty(), "{parsed:?} {rest:?} {last:?}");
        // Keys in another order: the scanner lets go, the end's parse sends the call.
        let mut s = ToolStream::new(ToolFormat::Hermes, true);
        s.push("<tool_call>\n{\"name\": \"a\",\"arguments\": {}}\n</tool_call>");
        assert!(s.deltas().is_empty());
        assert_eq!(joined(&s.finish(None).2), vec![("a".to_string(), "{}".to_string())]);
        // Two calls where at most one is allowed.
        let two = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let mut s = ToolStream::new(ToolFormat::Hermes, false);
        s.push(two);
        let (parsed, _, deltas) = s.finish(Some(1));
        assert_eq!(parsed.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a"]);
        assert_eq!(joined(&deltas), vec![("a".to_string(), "{}".to_string())]);
    }
}
