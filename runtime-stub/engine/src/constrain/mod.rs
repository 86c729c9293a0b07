//! Constrained decoding: a request's output held to a grammar (a JSON schema,
//! any JSON object, a Lark grammar or a regular expression) by llguidance, the
//! engine behind MAX's, vLLM's and llama.cpp's structured output.
//!
//! [`Grammars`] is built once per artifact: llguidance's token trie of the
//! artifact's vocabulary (each token's bytes, from its tokenizer.json) and its
//! parser factory. Each constrained request gets a [`Constraint`]: before each
//! of its tokens is sampled, the mask of the tokens the grammar allows next;
//! after, the token is committed. The engine computes the next masks on a helper
//! thread while the model's step runs (`engine/mod.rs`), so a mask costs the
//! step nothing unless it takes longer than the step. A grammar that reaches its
//! end allows only end-of-sequence tokens, which ends the reply.
//!
//! A JSON schema's objects that declare their properties and do not say
//! `additionalProperties` take only those properties (`schema.rs`), as OpenAI's
//! strict mode and llama.cpp's and xgrammar's converters read them.

pub mod harmony;
pub mod reasoning;
pub mod schema;
pub mod tools;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// A Lark grammar (llguidance's dialect: `start: ...`, `%json {...}`, regular expressions in `/.../`).
    Lark(String),
    /// Text matching a regular expression.
    Regex(String),
}

/// JSON as `json.dumps` writes it (`", "` and `": "`, no other whitespace),
/// unless the schema's own `x-guidance` says otherwise. llguidance's default,
/// any whitespace between tokens, lets a small model spend its tokens on
/// newlines and blanks inside an object.
fn with_json_layout(mut schema: Value) -> Value {
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

impl Grammar {
    /// What llguidance builds; a schema's objects are closed to their declared
    /// properties first (`schema.rs`), which may refuse the schema.
    fn top_level(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(with_json_layout(serde_json::json!({"type": "object"}))),
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_json_layout(schema::close_objects(s).map_err(|e| e.to_string())?)),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
        })
    }
}

/// The artifact's vocabulary as llguidance sees it: the trie of every token's
/// bytes, and the artifact's own tokenizer for text that grammars force.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Grammars for one artifact's vocabulary.
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// Builds the token trie of `tokenizer_json` for a model of `vocab` tokens
    /// whose end-of-sequence tokens are `eos`.
    pub fn new(tokenizer_json: &str, tokenizer: &tokenizers::Tokenizer, vocab: usize, eos: &[u32]) -> Result<Grammars, String> {
        let json: Value = serde_json::from_str(tokenizer_json).map_err(|e| format!("the tokenizer is not JSON: {e}"))?;
        // llguidance asserts on vocabularies it does not expect: such a panic is an
        // error for this request, not a crash of the server.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| "llguidance could not read this tokenizer's vocabulary".to_string())?
            .map_err(|e| format!("structured output needs a byte-level or byte-fallback tokenizer: {e}"))?;
        let mut words = bytes;
        words.resize(vocab.max(words.len()), vec![]);
        let first_eos = eos.first().copied().unwrap_or(u32::MAX);
        let mut trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, first_eos), &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory: Arc::new(factory) })
    }

    /// A constraint for one request; an error says why the grammar cannot be built.
    pub fn constraint(&self, grammar: &Grammar) -> Result<Constraint, String> {
        let parser = self.factory.create_parser(grammar.top_level()?).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, mask: None })
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, when computed ahead.
    mask: Option<Result<SimpleVob, String>>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("prepared", &self.mask.is_some()).finish()
    }
}

impl Constraint {
    /// Whether the next token's mask is already computed.
    pub fn is_prepared(&self) -> bool {
        self.mask.is_some()
    }

    /// Computes the next token's mask (the engine calls this on a helper
    /// thread while the model's step runs).
    pub fn prepare(&mut self) {
        if self.mask.is_none() {
            self.mask = Some(self.matcher.compute_mask_or_eos().map_err(|e| e.to_string()));
        }
    }

    /// Sets every logit the grammar does not allow next to minus infinity.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.prepare();
        let mask = self.mask.as_ref().expect("prepared just above").as_ref().map_err(Clone::clone)?;
        for (t, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(t as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances the grammar past `token` (one the mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        self.mask = None;
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar has reached its end: only end-of-sequence tokens may follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE vocabulary of single characters and a few words.
    fn grammars() -> (Grammars, tokenizers::Tokenizer) {
        let mut vocab = serde_json::Map::new();
        let pieces: Vec<String> = "{}[]\":, 0123456789abcdefghijklmnopqrstuvwxyz".chars().map(|c| c.to_string()).chain(["true", "false", "null", "\"a\""].map(String::from)).collect();
        for (i, p) in pieces.iter().enumerate() {
            vocab.insert(p.replace(' ', "Ġ"), json_id(i));
        }
        let eos = pieces.len();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": eos, "content": "<eos>", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false},
        })
        .to_string();
        let tokenizer: tokenizers::Tokenizer = json.parse().unwrap();
        (Grammars::new(&json, &tokenizer, eos + 1, &[eos as u32]).unwrap(), tokenizer)
    }

    fn json_id(i: usize) -> Value {
        Value::from(i)
    }

    /// Greedily takes, at each step, the first allowed token of `preferred`
    /// (else the first allowed token at all) until the grammar stops.
    fn walk(c: &mut Constraint, tokenizer: &tokenizers::Tokenizer, vocab: usize, preferred: &[&str]) -> String {
        let mut out = String::new();
        for _ in 0..200 {
            if c.is_stopped() {
                break;
            }
            let mut logits = vec![0.0f32; vocab];
            c.apply(&mut logits).unwrap();
            let allowed: Vec<usize> = (0..vocab).filter(|&t| logits[t].is_finite()).collect();
            assert!(!allowed.is_empty(), "nothing allowed after {out:?}");
            let text = |t: usize| tokenizer.decode(&[t as u32], false).unwrap();
            let pick = preferred.iter().find_map(|p| allowed.iter().copied().find(|&t| text(t) == *p)).unwrap_or(allowed[0]);
            if pick == vocab - 1 {
                break;
            }
            out.push_str(&text(pick));
            c.commit(pick as u32).unwrap();
        }
        out
    }

    #[test]
    fn a_schema_allows_only_valid_json_and_ends() {
        let (g, tok) = grammars();
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
        let mut c = g.constraint(&Grammar::JsonSchema(schema)).unwrap();
        // Whatever is preferred, only `{"a":<digits>}` can come out.
        let out = walk(&mut c, &tok, 50, &["x", "\"a\"", "}", "7"]);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v["a"].is_i64(), "{out}");
    }

    /// An object that declares its properties and does not say
    /// `additionalProperties` takes no other key, however much one is
    /// preferred; `additionalProperties: true` still lets one in.
    #[test]
    fn objects_take_only_their_declared_properties_unless_they_say_otherwise() {
        let (g, tok) = grammars();
        let preferred = ["\"a\"", "\"", "a", "}", "7"];
        let closed = serde_json::json!({"type": "object", "properties": {"b": {"type": "integer"}}});
        let out = walk(&mut g.constraint(&Grammar::JsonSchema(closed)).unwrap(), &tok, 50, &preferred);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v.as_object().unwrap().keys().all(|k| k == "b"), "{out}");
        let open = serde_json::json!({"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": true});
        let out = walk(&mut g.constraint(&Grammar::JsonSchema(open)).unwrap(), &tok, 50, &preferred);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v.get("a").is_some(), "an open object takes other keys: {out}");
        // A composition is closed as one object: the branch's required `a` is
        // allowed beside the parent's `k`, and nothing else is.
        let composed = serde_json::json!({"type": "object", "properties": {"k": {"type": "integer"}}, "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]});
        let out = walk(&mut g.constraint(&Grammar::JsonSchema(composed)).unwrap(), &tok, 50, &["\"a\"", "\"", "x", "}", "7"]);
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(v["a"].is_i64() && v.as_object().unwrap().keys().all(|k| k == "a" || k == "k"), "{out}");
        // A schema that cannot be honoured once closed names the keyword.
        let e = g.constraint(&Grammar::JsonSchema(serde_json::json!({"properties": {"a": {}}, "required": ["z"]}))).unwrap_err();
        assert!(e.contains("`required` at #"), "{e}");
    }

    #[test]
    fn a_regex_holds_the_text_to_it() {
        let (g, tok) = grammars();
        let mut c = g.constraint(&Grammar::Regex("ab[0-9]{3}".into())).unwrap();
        let out = walk(&mut c, &tok, 50, &["z", "a", "b", "4"]);
        assert_eq!(out, "ab444");
    }

    #[test]
    fn grammars_that_cannot_be_built_are_errors() {
        let (g, _) = grammars();
        assert!(g.constraint(&Grammar::Lark("start: undefined_rule".into())).is_err());
        assert!(g.constraint(&Grammar::JsonSchema(serde_json::json!({"type": "no-such-type"}))).is_err());
        assert!(g.constraint(&Grammar::Regex("(unclosed".into())).is_err());
    }
}
