//! Chat templates: the model's own Jinja template (from the artifact), rendered with
//! minijinja as Hugging Face's `apply_chat_template` does, and the bookkeeping that
//! lets a conversation continue from the KV cache instead of re-running old turns.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// Renders `template` over `messages` like transformers' `apply_chat_template`
/// (`bos_token` / `eos_token` in scope, `raise_exception`, Python string methods).
pub fn render(template: &str, messages: &[Message], add_generation_prompt: bool, bos: &str, eos: &str) -> Result<String, Error> {
    let messages: Vec<serde_json::Value> = messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
    render_with_tools(template, &messages, None, add_generation_prompt, bos, eos)
}

/// [`render`] over messages as JSON (with `tool_calls`, `tool_call_id`, ...) and
/// the `tools` a template may describe, as transformers passes them.
pub fn render_with_tools(template: &str, messages: &[serde_json::Value], tools: Option<&[serde_json::Value]>, add_generation_prompt: bool, bos: &str, eos: &str) -> Result<String, Error> {
    let mut env = Environment::new();
    // transformers compiles chat templates with trim_blocks and lstrip_blocks.
    let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    env.add_template("chat", template)?;
    env.get_template("chat")?.render(context! {
        messages => minijinja::Value::from(minijinja::value::Serde(messages)),
        tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos,
        eos_token => eos,
    })
}

/// The length of the longest common prefix: how much of the cache a new prompt reuses.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_chatml_template_with_generation_prompt() {
        let t = "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let out = render(t, &[Message::new("user", "  hi ")], true, "<s>", "</s>").unwrap();
        assert_eq!(out, "<|user|>hi\n<|assistant|>");
        assert!(render("{{ raise_exception('no') }}", &[], false, "", "").is_err());
        let py = render("{{ messages[0].content.strip().upper() }}", &[Message::new("user", " a ")], false, "", "").unwrap();
        assert_eq!(py, "A");
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
    }
}
