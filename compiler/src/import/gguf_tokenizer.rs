//! Rebuilds a Hugging Face `tokenizer.json` from GGUF `tokenizer.ggml.*` metadata.
//!
//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the pre-tokenizer is chosen
//! from `tokenizer.ggml.pre` with the same table llama.cpp uses. SentencePiece
//! (`"llama"`: Llama 2, Mistral, Phi-3, Gemma files): the BPE that transformers'
//! `LlamaConverter` builds from a SentencePiece model, its merges derived from
//! the token scores as its `SentencePieceExtractor` does, byte fallback, and the
//! `▁` word boundary. WordPiece (`"bert"`): BERT's tokenizer.json, the pieces'
//! `##` restored from llama.cpp's `▁` convention. Each way the rebuilt tokenizer encodes as the model's
//! transformers tokenizer (tests check the fixtures' tokenizers and llama.cpp's
//! own tokenizer tests, tests/golden/gguf/vocab).


use serde_json::{json, Value};

use super::gguf::{GgufFile, MetaValue};
use crate::error::{Error, Result};

/// GPT-2's split regex, as byte-level BPE tokenizers without a custom one use it.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// `tokenizer.ggml.pre` values this importer understands.
pub const SUPPORTED_PRE: &[&str] = &["default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2"];

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_byte_level(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// Builds the tokenizer.json text for a GGUF file's vocabulary (of the model's
/// `vocab_size` embedding rows at most).
pub fn tokenizer_json(gguf: &GgufFile, vocab_size: usize) -> Result<String> {
    let path = &gguf.path;
    let str_key = |k: &str| gguf.get(k).and_then(MetaValue::as_str);
    let model = str_key("tokenizer.ggml.model")
        .ok_or_else(|| Error::invalid(path, "tokenizer.ggml.model", "required metadata key is missing; the GGUF has no tokenizer"))?;
    match model {
        "gpt2" => {}
        "llama" => return sentencepiece_json(gguf, vocab_size),
        "bert" => return wordpiece_json(gguf, vocab_size),
        _ => {
            return Err(Error::invalid(
                path,
                "tokenizer.ggml.model",
                format!("tokenizer model `{model}` is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece), bert (WordPiece)"),
            ))
        }
    }
    let pre = str_key("tokenizer.ggml.pre").unwrap_or("default");
    let pre_tokenizer = match pre {
        // `gpt-2` is llama.cpp's spelling (its converter writes it for GPT-2's
        // byte-level regex); `gpt2` is kept for files that used it before.
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama-bpe" | "llama3" => split_then_byte_level(LLAMA3_REGEX),
        "qwen2" => split_then_byte_level(QWEN2_REGEX),
        other => {
            return Err(Error::invalid(
                path,
                "tokenizer.ggml.pre",
                format!("pre-tokenizer `{other}` is not supported; supported: {}", SUPPORTED_PRE.join(", ")),
            ))
        }
    };
    let tokens = token_strings(gguf)?;
    let merges = gguf
        .get("tokenizer.ggml.merges")
        .and_then(MetaValue::as_array)
        .ok_or_else(|| Error::invalid(path, "tokenizer.ggml.merges", "required array is missing"))?;
    let types = token_types(gguf, tokens.len())?;
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, &t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(id));
        if let Some(special) = added_kind(&types, id) {
            added.push(added_token(id, t, special));
        }
    }
    let merges: Vec<&str> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| m.as_str().ok_or_else(|| Error::invalid(path, "tokenizer.ggml.merges", format!("entry {i} is not a string"))))
        .collect::<Result<_>>()?;
    // llama.cpp adds BOS by default to the vocabularies of its Llama 3
    // pre-tokenizer (`llama-bpe`, `llama3`) and to no other byte-level BPE one,
    // when the file has no `add_bos_token`.
    let post_processor = post_processor(gguf, &tokens, matches!(pre, "llama-bpe" | "llama3"))?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let text = serde_json::to_string(&tokenizer).expect("JSON values always serialize");
    super::check_tokenizer(&text, path, vocab_size)?;
    Ok(text)
}

/// The token strings of `tokenizer.ggml.tokens` (non-empty).
fn token_strings<'g>(gguf: &'g GgufFile) -> Result<Vec<&'g str>> {
    let path = &gguf.path;
    let tokens = gguf
        .get("tokenizer.ggml.tokens")
        .and_then(MetaValue::as_array)
        .ok_or_else(|| Error::invalid(path, "tokenizer.ggml.tokens", "required array is missing"))?;
    if tokens.is_empty() {
        return Err(Error::invalid(path, "tokenizer.ggml.tokens", "the vocabulary is empty; the GGUF's tokenizer is damaged: convert the model again"));
    }
    tokens
        .iter()
        .enumerate()
        .map(|(id, t)| t.as_str().ok_or_else(|| Error::invalid(path, "tokenizer.ggml.tokens", format!("entry {id} is not a string"))))
        .collect()
}

/// One entry per token from array `key`, each read by `read` (`what` names
/// it in errors), or `None` when the file has no such array; any other
/// length is refused.
fn per_token<T>(gguf: &GgufFile, key: &str, tokens: usize, what: &str, read: impl Fn(&MetaValue) -> Option<T>) -> Result<Option<Vec<T>>> {
    let path = &gguf.path;
    match gguf.get(key) {
        None => Ok(None),
        Some(MetaValue::Array(values)) if values.len() == tokens => values
            .iter()
            .enumerate()
            .map(|(i, v)| read(v).ok_or_else(|| Error::invalid(path, key, format!("entry {i} is {v}, not a {what}"))))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => Err(Error::invalid(path, key, format!("{other}, but tokenizer.ggml.tokens has {tokens} entries: there must be one {what} per token"))),
    }
}

/// `tokenizer.ggml.token_type`, one per token as llama.cpp requires: anything
/// else would mark the wrong tokens special.
fn token_types(gguf: &GgufFile, tokens: usize) -> Result<Option<Vec<u64>>> {
    per_token(gguf, "tokenizer.ggml.token_type", tokens, "token type", MetaValue::as_u64)
}

/// Whether token `id` is an added token, and if so whether it is special:
/// llama.cpp's types 3 (control: special) and 4 (user-defined).
fn added_kind(types: &Option<Vec<u64>>, id: usize) -> Option<bool> {
    match types.as_ref().map_or(1, |ts| ts[id]) {
        3 => Some(true),
        4 => Some(false),
        _ => None,
    }
}

/// An entry of tokenizer.json's `added_tokens`.
fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": special,
    })
}

/// Bool key `key`, `default` when absent; another type is refused.
fn bool_key(gguf: &GgufFile, key: &str, default: bool) -> Result<bool> {
    match gguf.get(key) {
        None => Ok(default),
        Some(MetaValue::Bool(b)) => Ok(*b),
        Some(other) => Err(Error::invalid(&gguf.path, key, format!("expected a bool, found {other}"))),
    }
}

/// The id that id key `key` holds, checked against a vocabulary of `tokens`
/// (`None` when absent).
fn token_id(gguf: &GgufFile, key: &str, tokens: usize) -> Result<Option<usize>> {
    match gguf.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < tokens => Ok(Some(id as usize)),
            _ => Err(Error::invalid(&gguf.path, key, format!("{v} is outside the vocabulary of {tokens} tokens"))),
        },
    }
}

/// A TemplateProcessing post-processor that puts `head` before and `tail`
/// after each sequence (each a token's text and id).
fn template(head: Option<(&str, usize)>, tail: Option<(&str, usize)>) -> Value {
    let (mut single, mut pair, mut special) = (Vec::new(), Vec::new(), serde_json::Map::new());
    for (t, id) in head.iter().chain(&tail) {
        special.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    if let Some((h, _)) = head {
        single.push(json!({"SpecialToken": {"id": h, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": h, "type_id": 0}}));
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some((t, _)) = tail {
        single.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    if let Some((t, _)) = tail {
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 1}}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special})
}

/// A SentencePiece (`tokenizer.ggml.model = "llama"`) vocabulary as the
/// tokenizer.json transformers' `LlamaConverter` makes of the same model: BPE
/// over the pieces with merges ranked by the merged piece's score (every
/// split of a piece into two pieces, highest score first, then longer halves,
/// as transformers' `generate_merges` orders them), byte fallback to the `<0xXX>`
/// pieces, unknown pieces fused, and spaces as `▁` with one prepended (unless
/// `tokenizer.ggml.add_space_prefix` is false). BOS is added unless
/// `tokenizer.ggml.add_bos_token` says otherwise (llama.cpp's default for
/// SentencePiece models).
fn sentencepiece_json(gguf: &GgufFile, vocab_size: usize) -> Result<String> {
    let path = &gguf.path;
    let tokens = token_strings(gguf)?;
    let scores = per_token(gguf, "tokenizer.ggml.scores", tokens.len(), "score", MetaValue::as_f64)?
        .ok_or_else(|| Error::invalid(path, "tokenizer.ggml.scores", "required by a SentencePiece (`llama`) vocabulary, and missing"))?;
    let types = token_types(gguf, tokens.len())?;
    let mut ids = std::collections::HashMap::with_capacity(tokens.len());
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, &t) in tokens.iter().enumerate() {
        ids.entry(t).or_insert(id);
        vocab.insert(t.to_string(), json!(id));
        if let Some(special) = added_kind(&types, id) {
            added.push(added_token(id, t, special));
        }
    }
    // Every split of a piece into two pieces, ordered within the piece by the
    // halves' ids, then all by the piece's score, highest first (a stable sort).
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for (id, &piece) in tokens.iter().enumerate() {
        let mut local: Vec<(usize, usize, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*ids.get(l)?, *ids.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(a, b, _, _)| (a, b));
        merges.extend(local.into_iter().map(|(_, _, l, r)| (l, r, scores[id])));
    }
    // transformers' generate_merges: by score, then the longer left and right
    // halves first (in characters), all descending; ties keep their order.
    let chars = |s: &str| s.chars().count();
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(chars(b.0).cmp(&chars(a.0))).then(chars(b.1).cmp(&chars(a.1))));
    let merges: Vec<Value> = merges.into_iter().map(|(l, r, _)| json!([l, r])).collect();
    let unk = token_id(gguf, "tokenizer.ggml.unknown_token_id", tokens.len())?.map(|id| tokens[id]);
    let space_prefix = bool_key(gguf, "tokenizer.ggml.add_space_prefix", true)?;
    let mut normalizers = Vec::new();
    if space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    let post_processor = post_processor(gguf, &tokens, true)?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": if space_prefix { 1 } else { 0 }, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let text = serde_json::to_string(&tokenizer).expect("JSON values always serialize");
    super::check_tokenizer(&text, path, vocab_size)?;
    Ok(text)
}

/// A WordPiece (`tokenizer.ggml.model = "bert"`) vocabulary as BERT's
/// tokenizer.json has it. llama.cpp's converter writes word-initial pieces
/// with a `▁` in front and continuation pieces without their `##`, control
/// tokens as they are; this undoes that (`▁x` is `x`, another normal piece `x`
/// is `##x`). Text is lowercased (unless `normalizer.lowercase` is false) and
/// accents stripped, split at whitespace,
/// punctuation and CJK characters (BERT's normalizer and pre-tokenizer, as
/// llama.cpp's WordPiece tokenizer does), and `[CLS] ... [SEP]` added around
/// it (the file's `cls_token_id` and `seperator_token_id`, llama.cpp's
/// spelling), unless `add_bos_token` / `add_eos_token` say otherwise.
fn wordpiece_json(gguf: &GgufFile, vocab_size: usize) -> Result<String> {
    let path = &gguf.path;
    let tokens = token_strings(gguf)?;
    let types = token_types(gguf, tokens.len())?;
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut pieces = Vec::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, &t) in tokens.iter().enumerate() {
        let piece = if added_kind(&types, id) == Some(true) {
            added.push(added_token(id, t, true));
            t.to_string()
        } else if let Some(word) = t.strip_prefix('\u{2581}') {
            word.to_string()
        } else {
            format!("##{t}")
        };
        vocab.entry(piece.clone()).or_insert(json!(id));
        pieces.push(piece);
    }
    // A special token as (its piece in the rebuilt vocabulary, its id).
    let special = |key: &str| -> Result<Option<(&str, usize)>> { Ok(token_id(gguf, key, tokens.len())?.map(|id| (pieces[id].as_str(), id))) };
    let unk = special("tokenizer.ggml.unknown_token_id")?
        .ok_or_else(|| Error::invalid(path, "tokenizer.ggml.unknown_token_id", "required by a WordPiece (`bert`) vocabulary, and missing"))?
        .0;
    let (add_cls, add_sep) = (bool_key(gguf, "tokenizer.ggml.add_bos_token", true)?, bool_key(gguf, "tokenizer.ggml.add_eos_token", true)?);
    // Older files name [CLS] / [SEP] as cls / seperator, newer ones as BOS / EOS.
    let cls = special("tokenizer.ggml.cls_token_id")?.or(special("tokenizer.ggml.bos_token_id")?).filter(|_| add_cls);
    let sep = special("tokenizer.ggml.seperator_token_id")?.or(special("tokenizer.ggml.eos_token_id")?).filter(|_| add_sep);
    // Cased BERTs: the converter's `normalizer.lowercase` (absent: lowercase, as llama.cpp does).
    let lowercase = bool_key(gguf, "tokenizer.ggml.normalizer.lowercase", true)?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": lowercase},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": template(cls, sep),
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": unk, "continuing_subword_prefix": "##", "max_input_chars_per_word": 100, "vocab": vocab},
    });
    let text = serde_json::to_string(&tokenizer).expect("JSON values always serialize");
    super::check_tokenizer(&text, path, vocab_size)?;
    Ok(text)
}

/// The post-processor that adds what the GGUF's `tokenizer.ggml.add_bos_token` /
/// `add_eos_token` ask for (llama.cpp's `llama_tokenize` with `add_special`):
/// BOS before and EOS after a text; `bos_by_default` when the file has no
/// `add_bos_token` (llama.cpp adds BOS to SentencePiece vocabularies and to
/// byte-level BPE ones with the Llama 3 pre-tokenizer then). A
/// flag set without its token id is refused.
fn post_processor<'t>(gguf: &GgufFile, tokens: &[&'t str], bos_by_default: bool) -> Result<Value> {
    let path = &gguf.path;
    let wanted = |flag: &str, default: bool, id_key: &str| -> Result<Option<(&'t str, usize)>> {
        let key = format!("tokenizer.ggml.{flag}");
        if !bool_key(gguf, &key, default)? {
            return Ok(None);
        }
        let id_key = format!("tokenizer.ggml.{id_key}");
        if gguf.get(&id_key).and_then(MetaValue::as_u64).is_none() {
            return Err(Error::invalid(path, key.as_str(), format!("is true, but `{id_key}` is missing: the token to add is unknown")));
        }
        Ok(token_id(gguf, &id_key, tokens.len())?.map(|id| (tokens[id], id)))
    };
    Ok(template(wanted("add_bos_token", bos_by_default, "bos_token_id")?, wanted("add_eos_token", false, "eos_token_id")?))
}
