//! Reasoning: the thinking of models that write it between `<think>` and
//! `</think>` (DeepSeek-R1, Qwen3, SmolLM3) kept apart from the answer, as
//! OpenAI-compatible servers return it in `reasoning_content`.
//!
//! [`ThinkSplitter`] takes the reply's text as it streams and hands out each
//! piece as reasoning or as content, holding back the end of a piece while it
//! could be the start of a tag.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace seen yet: a `<think>` may still open.
    Start,
    Thinking,
    Answering,
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
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        // Whitespace, or the start of the tag: wait.
                        return (reasoning, content);
                    } else {
                        self.state = State::Answering;
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
        match self.state {
            State::Thinking => (held, String::new()),
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
            let mut s = ThinkSplitter::new(false);
            let (mut r, mut c) = (String::new(), String::new());
            let bytes: Vec<char> = reply.chars().collect();
            for piece in bytes.chunks(size) {
                let (pr, pc) = s.push(&piece.iter().collect::<String>());
                assert!(!pr.contains(CLOSE) && !pc.contains(OPEN), "a tag handed out: {pr:?} {pc:?}");
                r.push_str(&pr);
                c.push_str(&pc);
            }
            let (pr, pc) = s.finish();
            r.push_str(&pr);
            c.push_str(&pc);
            assert_eq!((r, c), whole, "pieces of {size}");
        }
    }
}
