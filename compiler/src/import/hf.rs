//! Import of a Hugging Face model directory: config.json, safetensors, tokenizer, chat template.

use std::path::Path;

use serde_json::Value;

use super::config::ModelConfig;
use super::weights::WeightStore;
use super::{check_tokenizer, file_stem, safetensors, GenerationDefaults, ImportedModel};
use crate::error::{Error, Result};

fn read_required(dir: &Path, name: &str, what: &str) -> Result<String> {
    let path = dir.join(name);
    if !path.exists() {
        return Err(Error::invalid(&path, name, format!("not found; an HF model directory needs {what}")));
    }
    std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))
}

fn parse_json(path: &Path, text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| Error::invalid(path, "json", format!("not valid JSON: {e}")))
}

/// Imports an HF directory.
pub fn import_dir(dir: &Path, architecture: Option<&str>) -> Result<ImportedModel> {
    let config_path = dir.join("config.json");
    let config_text = read_required(dir, "config.json", "config.json, *.safetensors and tokenizer.json")?;
    let mut config = ModelConfig::from_hf_json(&parse_json(&config_path, &config_text)?, &config_path, architecture)?;
    let mut input_files = vec![config_path];
    if let Some(enc) = config.encoder.as_mut() {
        // sentence-transformers layout: 1_Pooling/config.json and a Normalize module.
        let pooling_path = dir.join("1_Pooling/config.json");
        if pooling_path.exists() {
            let text = std::fs::read_to_string(&pooling_path).map_err(|e| Error::io(&pooling_path, e))?;
            let p = parse_json(&pooling_path, &text)?;
            let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
            enc.mean_pooling = match (flag("pooling_mode_mean_tokens"), flag("pooling_mode_cls_token")) {
                (true, false) => true,
                (false, true) => false,
                _ => {
                    return Err(Error::invalid(
                        &pooling_path,
                        "pooling_mode_*",
                        "exactly one of pooling_mode_mean_tokens and pooling_mode_cls_token must be true; other poolings are not supported",
                    ))
                }
            };
            input_files.push(pooling_path);
        }
        let modules_path = dir.join("modules.json");
        if modules_path.exists() {
            let text = std::fs::read_to_string(&modules_path).map_err(|e| Error::io(&modules_path, e))?;
            enc.normalize = text.contains("sentence_transformers.models.Normalize");
            input_files.push(modules_path);
        }
    }

    let mut weights = WeightStore::default();
    for file in safetensors::list_files(dir)? {
        safetensors::load_file(&file, &mut weights)?;
        input_files.push(file);
    }
    check_layer_count(&weights, config.num_layers, &dir.join("config.json"))?;

    check_embedding_rows(&weights, &config)?;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_json = read_required(dir, "tokenizer.json", "tokenizer.json to tokenize prompts")?;
    check_tokenizer(&tokenizer_json, &tokenizer_path, config.vocab_size)?;
    input_files.push(tokenizer_path);

    let template_path = dir.join("chat_template.jinja");
    let tokenizer_config_path = dir.join("tokenizer_config.json");
    let chat_template = if template_path.exists() {
        input_files.push(template_path.clone());
        Some(std::fs::read_to_string(&template_path).map_err(|e| Error::io(&template_path, e))?)
    } else if tokenizer_config_path.exists() {
        let text = std::fs::read_to_string(&tokenizer_config_path).map_err(|e| Error::io(&tokenizer_config_path, e))?;
        input_files.push(tokenizer_config_path.clone());
        let invalid = |what: String| Error::invalid(&tokenizer_config_path, "chat_template", what);
        match parse_json(&tokenizer_config_path, &text)?.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the one called "default", as transformers takes it.
            Some(Value::Array(list)) => {
                let named = |t: &Value| t.get("name").and_then(Value::as_str).map(str::to_string);
                match list.iter().find(|t| named(t).as_deref() == Some("default")) {
                    Some(t) => Some(
                        t.get("template")
                            .and_then(Value::as_str)
                            .ok_or_else(|| invalid("the template named \"default\" has no \"template\" string".into()))?
                            .to_string(),
                    ),
                    None => {
                        let names: Vec<String> = list.iter().map(|t| named(t).unwrap_or_else(|| t.to_string())).collect();
                        return Err(invalid(format!(
                            "a list of named templates ({}) without one named \"default\", the one maxc (as transformers) uses; add it, or write the template to use as chat_template.jinja",
                            names.join(", ")
                        )));
                    }
                }
            }
            Some(other) => return Err(invalid(format!("{other}: expected the template's text (a string) or a list of named templates"))),
        }
    } else {
        None
    };

    let generation_path = dir.join("generation_config.json");
    let generation = if generation_path.exists() {
        let text = std::fs::read_to_string(&generation_path).map_err(|e| Error::io(&generation_path, e))?;
        input_files.push(generation_path.clone());
        let g = parse_json(&generation_path, &text)?;
        if !g.is_object() {
            return Err(Error::invalid(&generation_path, "generation_config", format!("{g}: expected a JSON object of generation settings")));
        }
        let sampling = match g.get("do_sample") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(Error::invalid(&generation_path, "do_sample", format!("{other}: expected true or false"))),
        };
        // The sampling defaults are checked as the command line's flags are: a
        // value of the wrong type or out of range is refused, never dropped or
        // stored as given.
        let invalid = |k: &str, what: String| Error::invalid(&generation_path, k, what);
        let f = |k: &str, lo: f32, hi: f32| -> Result<Option<f32>> {
            match g.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_f64().map(|x| x as f32).filter(|x| x.is_finite()) {
                    Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                    Some(x) => Err(invalid(k, format!("{x} must be between {lo} and {hi}"))),
                    None => Err(invalid(k, format!("expected a finite number, found {v}"))),
                },
            }
        };
        let u = |k: &str, lo: u64| -> Result<Option<u32>> {
            match g.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_u64().filter(|&n| n >= lo && n <= u32::MAX as u64) {
                    Some(n) => Ok(Some(n as u32)),
                    None => Err(invalid(k, format!("expected an integer >= {lo}, found {v}"))),
                },
            }
        };
        let temperature = f("temperature", 0.0, f32::MAX)?;
        // transformers stops on these too (Llama 3 Instruct's <|eot_id|> is only here).
        for id in (super::config::Fields { json: &g, path: &generation_path }).token_ids("eos_token_id")? {
            if id as usize >= config.vocab_size {
                return Err(invalid("eos_token_id", format!("{id} is outside the vocabulary of {} tokens", config.vocab_size)));
            }
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
        let repetition_penalty = match g.get("repetition_penalty") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_f64().filter(|x| x.is_finite() && *x > 0.0) {
                Some(x) => Some(x as f32),
                None => return Err(invalid("repetition_penalty", format!("{v} must be a number above 0 (1 turns it off)"))),
            },
        };
        GenerationDefaults {
            // Greedy unless the checkpoint asks for sampling, as transformers does.
            temperature: if sampling { temperature } else { Some(0.0) },
            top_k: u("top_k", 0)?,
            top_p: f("top_p", 0.0, 1.0)?,
            min_p: f("min_p", 0.0, 1.0)?,
            max_new_tokens: u("max_new_tokens", 1)?,
            repetition_penalty,
        }
    } else {
        GenerationDefaults::default()
    };

    Ok(ImportedModel {
        name: file_stem(dir),
        source: dir.to_path_buf(),
        config,
        weights,
        tokenizer_json,
        chat_template,
        generation,
        input_files,
    })
}

/// The token embedding's rows against config.json's `vocab_size`, before the
/// tokenizer is checked against that size: when they disagree, config.json is
/// the odd one out and the message says so (the builder checks every other shape).
fn check_embedding_rows(weights: &WeightStore, config: &ModelConfig) -> Result<()> {
    const EMBEDDINGS: [&str; 3] = ["model.embed_tokens.weight", "transformer.wte.weight", "embeddings.word_embeddings.weight"];
    for name in EMBEDDINGS {
        if let Some(entry) = weights.get(name) {
            if entry.shape.first() != Some(&config.vocab_size) {
                return Err(Error::WeightShape {
                    path: weights.file_of(name).expect("present").to_path_buf(),
                    name: name.to_string(),
                    expected: [&[config.vocab_size][..], entry.shape.get(1..).unwrap_or_default()].concat(),
                    found: entry.shape.clone(),
                    config: "config.json".into(),
                });
            }
        }
    }
    Ok(())
}

/// Refuses weights of layers past the config's layer count (`layers.N.`,
/// GPT-2's `h.N.`, BERT's `layer.N.` with N >= `num_hidden_layers`): the
/// checkpoint and config.json disagree, and compiling would drop those layers.
fn check_layer_count(weights: &WeightStore, layers: usize, config_path: &Path) -> Result<()> {
    for name in weights.names() {
        let parts: Vec<&str> = name.split('.').collect();
        for w in parts.windows(2) {
            if matches!(w[0], "layers" | "h" | "layer") {
                if let Ok(n) = w[1].parse::<usize>() {
                    if n >= layers {
                        return Err(Error::invalid(
                            config_path,
                            "num_hidden_layers",
                            format!(
                                "is {layers}, but the weights hold layer {n} (`{name}` in {}); fix config.json or the checkpoint",
                                weights.file_of(name).map_or_else(String::new, |p| p.display().to_string())
                            ),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}
