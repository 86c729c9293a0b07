//! OpenAI's harmony format, in which gpt-oss writes its replies: a reply is
//! messages, each a header (`<|channel|>analysis`, `<|channel|>final`, or a
//! tool call's `<|channel|>commentary to=functions.NAME <|constrain|>json`;
//! after the first, `<|start|>assistant` before it, and a recipient may come
//! before the channel) ended by `<|message|>`, then the body, ended by
//! `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the reply's last).
//! The `analysis` channel is the model's reasoning, `final` the answer, and a
//! message to `functions.NAME` a call whose body is the arguments' JSON
//! (vLLM's and llama.cpp's gpt-oss parsers read it the same way).
//!
//! [`messages`] reads whole messages out of text; `reasoning::ThinkSplitter`
//! splits a streamed reply by channel with [`header_route`] and
//! [`TERMINATORS`], and writes each call into the content in one layout
//! ([`call_header`]) for `tools::parse`.

/// What starts a message's header.
pub const HEADER_STARTS: [&str; 2] = ["<|start|>", "<|channel|>"];

/// What ends a header.
pub const MESSAGE: &str = "<|message|>";

/// What ends a message's body (a new header ends it too).
pub const TERMINATORS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];

/// Where a message's body goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// The `analysis` channel: reasoning.
    Reasoning,
    /// `final`, or commentary to no one (a preamble): content.
    Content,
    /// A message to `functions.NAME`: a call of `NAME`.
    Call(String),
}

/// The value of `key` in a header: the word after `<|key|>` (`channel`) or
/// after `to=` (`recipient`).
fn word_after<'a>(header: &'a str, marker: &str) -> Option<&'a str> {
    let at = header.find(marker)? + marker.len();
    let rest = header[at..].trim_start();
    let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
    Some(&rest[..end]).filter(|w| !w.is_empty())
}

/// Where the body of a message with `header` (the text before `<|message|>`)
/// goes: to its recipient when that is `functions.NAME`, else by its channel.
pub fn header_route(header: &str) -> Route {
    if let Some(name) = word_after(header, "to=").and_then(|r| r.strip_prefix("functions.")) {
        return Route::Call(name.to_string());
    }
    match word_after(header, "<|channel|>") {
        Some("analysis") => Route::Reasoning,
        _ => Route::Content,
    }
}

/// The header a call is written into the content with (the layout
/// `tools::parse` and the call grammar share).
pub fn call_header(name: &str) -> String {
    format!("<|channel|>commentary to=functions.{name} <|constrain|>json{MESSAGE}")
}

/// One message read out of text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub route: Route,
    pub body: String,
    /// Its bytes in the text, header to terminator.
    pub span: std::ops::Range<usize>,
}

/// The first of `markers` in `text` from `from`: (position, marker).
pub fn first_of<'m>(text: &str, from: usize, markers: &[&'m str]) -> Option<(usize, &'m str)> {
    markers.iter().filter_map(|m| text[from..].find(m).map(|at| (from + at, *m))).min_by_key(|(at, _)| *at)
}

/// The messages of `text` (a reply, or content with calls in it), in order;
/// text outside any message is not in them. A header without `<|message|>`
/// ends the reading; a body without a terminator runs to the end.
pub fn messages(text: &str) -> Vec<Message> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some((start, _)) = first_of(text, pos, &HEADER_STARTS) {
        let Some(m) = text[start..].find(MESSAGE) else { break };
        let header = &text[start..start + m];
        let body_at = start + m + MESSAGE.len();
        let (body_end, end) = match first_of(text, body_at, &TERMINATORS) {
            // A new message's header ends this one's body but is its own.
            Some((at, "<|start|>")) => (at, at),
            Some((at, t)) => (at, at + t.len()),
            None => (text.len(), text.len()),
        };
        out.push(Message { route: header_route(header), body: text[body_at..body_end].to_string(), span: start..end });
        pos = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gpt-oss reply as the harmony docs write one: reasoning, a preamble,
    /// a call (recipient before the channel, as the model may write it).
    #[test]
    fn messages_are_read_by_channel_and_recipient() {
        let reply = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
        let m = messages(reply);
        assert_eq!(m.iter().map(|m| (&m.route, m.body.as_str())).collect::<Vec<_>>(), [(&Route::Reasoning, "Need the weather."), (&Route::Content, "Checking."), (&Route::Call("get_weather".into()), "{\"city\": \"Paris\"}")]);
        assert_eq!(m[2].span.end, reply.len());
        assert_eq!(header_route("<|channel|>commentary to=functions.f <|constrain|>json"), Route::Call("f".into()));
        assert_eq!(header_route("<|channel|>final"), Route::Content);
        // A body cut off at the end of the text runs to it.
        assert_eq!(messages("<|channel|>final<|message|>The answer")[0].body, "The answer");
        assert!(messages("no harmony here").is_empty());
    }
}
