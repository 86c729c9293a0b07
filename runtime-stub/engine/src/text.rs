//! Generated token ids to text as they come: incremental decoding that never
//! hands out half a character, stop strings, and the text held back while it
//! could still be the start of one.
//!
//! Decoding the whole reply again for every token costs time quadratic in its
//! length; [`TextStream`] decodes a short window instead, as Hugging Face's
//! text-generation-inference does: the tokens from `prefix` on, minus what the
//! tokens from `prefix` to `read` gave, is the new text (a window keeps a token
//! or two of context, so tokenizers that drop a word's leading space at the
//! start of a decode still produce it). New text ending in U+FFFD is an
//! incomplete UTF-8 sequence and waits for the next token. The final text is
//! always the decode of the whole reply ([`TextStream::finish`]), so streamed
//! and non-streamed output end the same.
//!
//! Two choices of the request shape the text ([`TextOptions`]): whether the
//! stop string that ended the reply is part of it (vLLM's
//! `include_stop_str_in_output`, SGLang's `no_stop_trim`), and whether special
//! tokens (those the tokenizer flags `special`) are decoded or skipped
//! (`skip_special_tokens`).

use tokenizers::Tokenizer;

/// Why decoding failed (the tokenizer's message).
#[derive(Debug, thiserror::Error)]
#[error("decoding the generated tokens: {0}")]
pub struct DecodeError(String);

/// How a reply's tokens become its text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextOptions {
    /// The stop string that ended the reply ends its text too, instead of
    /// being cut off with what follows it.
    pub keep_stop: bool,
    /// Special tokens give no text (the tokenizer's `skip_special_tokens`).
    pub skip_special_tokens: bool,
}

/// The text of one reply so far.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    /// Every complete character decoded so far.
    text: String,
    /// What was handed out: a prefix of `text`, unless the tokenizer decoded
    /// earlier tokens differently once later ones came.
    handed: String,
    stops: Vec<String>,
    /// Characters held back while streaming: one less than the longest stop string's.
    hold: usize,
    /// Where the reply's text ends in `text` once a stop string appeared:
    /// where the first one starts, or where it ends with `keep_stop`.
    stopped_at: Option<usize>,
    options: TextOptions,
}

/// Where the text ends at the earliest stop string in `text[from..]`, if any:
/// before it, or after it with `keep`.
fn stop_end(text: &str, from: usize, stops: &[String], keep: bool) -> Option<usize> {
    let (at, stop) = stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|at| (from + at, s))).min_by_key(|&(at, s)| (at, std::cmp::Reverse(s.len())))?;
    Some(if keep { at + stop.len() } else { at })
}

impl TextStream {
    pub fn new(stops: Vec<String>, options: TextOptions) -> TextStream {
        let hold = stops.iter().map(|s| s.chars().count()).max().unwrap_or(1).saturating_sub(1);
        TextStream { stops, hold, options, ..TextStream::default() }
    }

    fn decode(&self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String, DecodeError> {
        tokenizer.decode(ids, self.options.skip_special_tokens).map_err(|e| DecodeError(e.to_string()))
    }

    /// Appends a token (end-of-sequence tokens are never given: they are not text).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<(), DecodeError> {
        self.ids.push(id);
        let before = self.decode(tokenizer, &self.ids[self.prefix..self.read])?;
        let after = self.decode(tokenizer, &self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            match after.strip_prefix(before.as_str()) {
                Some(new) => self.text.push_str(new),
                // The window decoded differently once extended: take the whole reply.
                None => self.text = self.decode(tokenizer, &self.ids)?,
            }
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        if self.stopped_at.is_none() {
            // A stop string can only end in the new text, but may start before it.
            let from = self.handed.len().min(self.text.len()).saturating_sub(self.stops.iter().map(String::len).max().unwrap_or(0));
            let from = (0..=from).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
            self.stopped_at = stop_end(&self.text, from, &self.stops, self.options.keep_stop);
        }
        Ok(())
    }

    /// Whether a stop string appeared: the reply ends before it.
    pub fn stopped(&self) -> bool {
        self.stopped_at.is_some()
    }

    /// Tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.ids
    }

    /// The text that can be handed out now and was not yet: everything up to a
    /// stop string (or through it, with `keep_stop`) once one appeared, else all but the last characters that
    /// could still begin one.
    pub fn take(&mut self) -> String {
        let sent = self.handed.len();
        if !self.text.starts_with(self.handed.as_str()) {
            // Earlier text decoded differently: wait for the end to reconcile.
            return String::new();
        }
        let end = match self.stopped_at {
            Some(at) => at,
            None => {
                let rest = &self.text[sent..];
                let keep = rest.chars().count().saturating_sub(self.hold);
                sent + rest.char_indices().nth(keep).map_or(rest.len(), |(i, _)| i)
            }
        };
        if end <= sent {
            return String::new();
        }
        let out = self.text[sent..end].to_string();
        self.handed.push_str(&out);
        out
    }

    /// Ends the reply: the rest of its text (the whole reply's decode, cut at a
    /// stop string), which completes what [`TextStream::take`] handed out.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, DecodeError> {
        let mut full = self.decode(tokenizer, &self.ids)?;
        if let Some(end) = stop_end(&full, 0, &self.stops, self.options.keep_stop) {
            full.truncate(end);
        }
        let rest = match full.strip_prefix(self.handed.as_str()) {
            Some(rest) => rest.to_string(),
            // What was handed out differs from the whole decode (a tokenizer
            // whose decoding of earlier tokens depends on later ones): hand out
            // what differs at the end, as much as can still be said.
            None => {
                let common = self.handed.chars().zip(full.chars()).take_while(|(a, b)| a == b).count();
                full.chars().skip(common).collect()
            }
        };
        self.handed = full.clone();
        self.text = full;
        Ok(rest)
    }

    /// The reply's text so far (complete characters, before any stop string, or
    /// through it with `keep_stop`).
    pub fn text(&self) -> &str {
        &self.text[..self.stopped_at.unwrap_or(self.text.len())]
    }
}
