//! Reasoning: the thinking of models that write it between `<think>` and
//! `</think>` (DeepSeek-R1, Qwen3, SmolLM3) kept apart from the answer, as
//! OpenAI-compatible servers return it in `reasoning_content`.
//!
//! [`ThinkSplitter`] takes the reply's text as it streams and hands out each
//! piece as reasoning or as content, holding back the end of a piece while it
//! could be the start of a tag. A reply that opens with a harmony header
//! (gpt-oss: `<|channel|>` or `<|start|>`, `harmony.rs`) is split by its
//! messages' channels instead: `analysis` is reasoning, the rest content, and
//! each call to a function goes into the content in one layout
//! (`harmony::call_header`, its body, `<|call|>`) for the tool-call parser.

use super::harmony::{call_header, first_of, header_route, Route, HEADER_STARTS, MESSAGE, TERMINATORS};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A header longer than this without `<|message|>` is not one: text.
const MAX_HEADER: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace seen yet: a `<think>` or a harmony header may still open.
    Start,
    Thinking,
    Answering,
    /// Harmony: a message's header, held until its `<|message|>`.
    Header,
    /// Harmony: a message's body, going where its header said.
    Body(Route),
}

/// Splits a streamed reply into reasoning and content.
#[derive(Debug)]
pub struct ThinkSplitter {
    state: State,
    held: String,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| s.len() >= n && s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..])).unwrap_or(0)
}

impl ThinkSplitter {
    /// `open`: the prompt already opened `<think>` (a template that starts the
    /// reply in its thinking), so the reply begins inside it.
    pub fn new(open: bool) -> ThinkSplitter {
        ThinkSplitter { state: if open { State::Thinking } else { State::Start }, held: String::new() }
    }

    /// Takes the next piece of text; returns (reasoning, content) to hand out now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.state.clone() {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if HEADER_STARTS.iter().any(|h| t.starts_with(h)) {
                        self.held = t.to_string();
                        self.state = State::Header;
                    } else if OPEN.starts_with(t) || HEADER_STARTS.iter().any(|h| h.starts_with(t)) {
                        // Whitespace, or the start of a tag: wait.
                        return (reasoning, content);
                    } else {
                        self.state = State::Answering;
                    }
                }
                State::Header => match self.held.find(MESSAGE) {
                    Some(at) => {
                        let route = header_route(&self.held[..at]);
                        if let Route::Call(name) = &route {
                            content.push_str(&call_header(name));
                        }
                        self.held = self.held[at + MESSAGE.len()..].to_string();
                        self.state = State::Body(route);
                    }
                    None => {
                        let t = self.held.trim_start();
                        let header = HEADER_STARTS.iter().any(|h| t.starts_with(h) || h.starts_with(t));
                        if header && self.held.len() <= MAX_HEADER {
                            return (reasoning, content);
                        }
                        // Text between messages that opens none: the rest is content.
                        self.state = State::Answering;
                    }
                },
                State::Body(route) => {
                    let (body, done) = match first_of(&self.held, 0, &TERMINATORS) {
                        Some((at, terminator)) => {
                            // A new header ends the body and is read as one.
                            let next = if terminator == "<|start|>" { at } else { at + terminator.len() };
                            (at, Some(next))
                        }
                        None => (self.held.len() - TERMINATORS.iter().map(|t| partial_tag(&self.held, t)).max().unwrap_or(0), None),
                    };
                    let text = &self.held[..body];
                    match route {
                        Route::Reasoning => reasoning.push_str(text),
                        Route::Content => content.push_str(text),
                        Route::Call(_) => {
                            content.push_str(text);
                            if done.is_some() {
                                content.push_str("<|call|>");
                            }
                        }
                    }
                    match done {
                        Some(next) => {
                            self.held = self.held[next..].to_string();
                            self.state = State::Header;
                        }
                        None => {
                            self.held = self.held[body..].to_string();
                            return (reasoning, content);
                        }
                    }
                }
                State::Thinking => match self.held.find(CLOSE) {
                    Some(at) => {
                        reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + CLOSE.len()..].trim_start().to_string();
                        self.state = State::Answering;
                    }
                    None => {
                        let keep = partial_tag(&self.held, CLOSE);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held = self.held[cut..].to_string();
                        return (reasoning, content);
                    }
                },
                State::Answering => {
                    content.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, content);
                }
            }
        }
    }

    /// The end of the reply: whatever was held back.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match &self.state {
            State::Thinking | State::Body(Route::Reasoning) => (held, String::new()),
            // An unfinished header (`<|start|>assistant` at the end) is no text.
            State::Header => (String::new(), String::new()),
            _ => (String::new(), held),
        }
    }
}

/// Splits a whole reply.
pub fn split(reply: &str, open: bool) -> (String, String) {
    let mut s = ThinkSplitter::new(open);
    let (mut r, mut c) = s.push(reply);
    let (r2, c2) = s.finish();
    r.push_str(&r2);
    c.push_str(&c2);
    (r, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_replies_split_at_the_tags() {
        assert_eq!(split("<think>step 1, step 2</think>\n\nThe answer is 4.", false), ("step 1, step 2".into(), "The answer is 4.".into()));
        assert_eq!(split("  \n<think>a</think>b", false), ("a".into(), "b".into()));
        assert_eq!(split("No thinking here.", false), (String::new(), "No thinking here.".into()));
        // The prompt opened the thinking: the reply starts inside it.
        assert_eq!(split("hmm</think>yes", true), ("hmm".into(), "yes".into()));
        // A reply cut off while thinking is all reasoning.
        assert_eq!(split("<think>still going", false), ("still going".into(), String::new()));
        // A tag later in an answer is text.
        assert_eq!(split("x <think>y</think>", false), (String::new(), "x <think>y</think>".into()));
    }

    /// Every way of cutting a reply into pieces gives the same split, and no piece
    /// handed out holds a tag.
    #[test]
    fn streamed_pieces_give_the_same_split() {
        let reply = "<think>Let me think: 2 + 2.</think>The answer is 4 </th no.";
        let whole = split(reply, false);
        for size in 1..=reply.len() {
            let got = streamed(reply, size, &|r, c| assert!(!r.contains(CLOSE) && !c.contains(OPEN), "a tag handed out: {r:?} {c:?}"));
            assert_eq!(got, whole, "pieces of {size}");
        }
    }

    /// `reply` pushed in pieces of `size` characters, each piece's reasoning and
    /// content passed to `check`, then the end: all the reasoning and content.
    fn streamed(reply: &str, size: usize, check: &dyn Fn(&str, &str)) -> (String, String) {
        let mut s = ThinkSplitter::new(false);
        let (mut r, mut c) = (String::new(), String::new());
        let chars: Vec<char> = reply.chars().collect();
        for piece in chars.chunks(size) {
            let (pr, pc) = s.push(&piece.iter().collect::<String>());
            check(&pr, &pc);
            r.push_str(&pr);
            c.push_str(&pc);
        }
        let (pr, pc) = s.finish();
        r.push_str(&pr);
        c.push_str(&pc);
        (r, c)
    }

    /// gpt-oss's harmony replies: the analysis channel is the reasoning, the
    /// final channel and preambles the content, a call goes into the content
    /// in `harmony::call_header`'s layout; the same in pieces of every size, and
    /// no marker but a call's reaches the content.
    #[test]
    fn harmony_replies_split_by_channel() {
        let reply = "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>";
        assert_eq!(split(reply, false), ("User asks 2+2.".into(), "It is 4.".into()));
        let call = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
        let want = ("Need weather.".to_string(), "Checking. <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>".to_string());
        assert_eq!(split(call, false), want);
        // Cut off inside the reasoning: all of it is reasoning.
        assert_eq!(split("<|channel|>analysis<|message|>still thinking", false), ("still thinking".into(), String::new()));
        for reply in [reply, call] {
            let whole = split(reply, false);
            for size in 1..=reply.chars().count() {
                let (r, c) = streamed(reply, size, &|r, _| assert!(!r.contains("<|"), "a marker in the reasoning: {r:?}"));
                // No marker reaches the content before the call's header.
                let before_call = &c[..c.find("<|channel|>commentary to=").unwrap_or(c.len())];
                assert!(!before_call.contains("<|"), "pieces of {size}: {c:?}");
                assert_eq!((r, c), whole, "pieces of {size}");
            }
        }
    }
}
