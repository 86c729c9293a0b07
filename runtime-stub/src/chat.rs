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
/// (`bos_token` / `eos_token` in scope, `raise_exception`, `strftime_now`,
/// Python string methods).
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
    // transformers' `strftime_now(format)` (gpt-oss's template writes the date
    // into its system message), in UTC.
    env.add_function("strftime_now", |format: String| -> Result<String, Error> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        strftime(&format, now).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
    });
    env.add_template("chat", template)?;
    env.get_template("chat")?.render(context! {
        messages => minijinja::Value::from(minijinja::value::Serde(messages)),
        tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos,
        eos_token => eos,
    })
}

/// `format` as Python's `time.strftime` writes the UTC time `unix_secs`, for
/// the specifiers chat templates use (`%Y %y %m %d %e %j %H %I %M %S %p %A %a
/// %B %b %%`); another is an error naming it.
pub fn strftime(format: &str, unix_secs: i64) -> Result<String, String> {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let (days, secs) = (unix_secs.div_euclid(86400), unix_secs.rem_euclid(86400));
    // Howard Hinnant's civil_from_days: the proleptic Gregorian date of a day count.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[(month - 1) as usize] + day + i64::from(leap && month > 2);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: %{other} is not supported; use %Y %y %m %d %e %j %H %I %M %S %p %A %a %B %b %%")),
            None => return Err("strftime_now: the format ends in a lone %".to_string()),
        }
    }
    Ok(out)
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

    /// Dates as Python's `time.strftime(f, time.gmtime(t))` writes them
    /// (values from CPython 3.11): a leap day, the epoch, a date before it,
    /// the end of a leap year; `strftime_now` renders in a template.
    #[test]
    fn strftime_writes_dates_as_python_does() {
        let f = "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %e %%";
        assert_eq!(strftime(f, 1_709_208_000).unwrap(), "2024-02-29 12:00:00 Thu Thursday Feb February 060 24 12PM 29 %");
        assert_eq!(strftime(f, 0).unwrap(), "1970-01-01 00:00:00 Thu Thursday Jan January 001 70 12AM  1 %");
        assert_eq!(strftime(f, -86_401).unwrap(), "1969-12-30 23:59:59 Tue Tuesday Dec December 364 69 11PM 30 %");
        assert_eq!(strftime(f, 1_735_689_599).unwrap(), "2024-12-31 23:59:59 Tue Tuesday Dec December 366 24 11PM 31 %");
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
        let out = render("Today: {{ strftime_now('%Y') }}", &[], false, "", "").unwrap();
        assert!(out.starts_with("Today: 20") && out.len() == "Today: 2026".len(), "{out}");
    }
}
