//! Chat templates rendered as `transformers` renders them for vLLM: a sandboxed Jinja2
//! environment with `trim_blocks`, `lstrip_blocks` and loop controls, Hugging Face's `tojson`,
//! `raise_exception` and `strftime_now`, Python's string and dict methods, Python's way of
//! printing values, and the `continue_final_message` cut.
//!
//! Rendering is bounded: minijinja's fuel caps the instructions one render may run (a template
//! looping over a client's messages costs in proportion to them; a runaway loop stops).

use crate::py_format::{json_dumps, py_str, JsonStyle};
use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::collections::{BTreeMap, HashSet};

/// Instructions one render may run: about 40,000 per message of a 1,000-message chat.
const FUEL: u64 = 50_000_000;

/// The marker `transformers` appends to the final message to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The variables the template reads from its context (what vLLM lets through from
    /// `chat_template_kwargs`).
    pub variables: HashSet<String>,
    /// The template text (content-format and developer-role detection read it).
    pub source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bytes", &self.source.len()).finish()
    }
}

/// What one render needs.
pub struct RenderArgs<'a> {
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// Special tokens and the accepted `chat_template_kwargs`, in that order of precedence
    /// (later wins).
    pub extra: &'a [(String, Value)],
}

impl ChatTemplate {
    /// Compiles `source`; an error names what minijinja could not parse.
    pub fn compile(source: &str) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&py_str(value)).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let text = without_generation_tags(source);
        env.add_template_owned("chat", text).map_err(|e| describe(&e))?;
        let variables = env
            .get_template("chat")
            .map(|t| t.undeclared_variables(false).into_iter().collect())
            .map_err(|e| describe(&e))?;
        Ok(ChatTemplate { env, variables, source: source.to_owned() })
    }

    /// Renders a conversation. Errors are the template's own (`raise_exception`) or a failed
    /// render, worded for the client.
    pub fn render(&self, args: RenderArgs<'_>) -> Result<String, String> {
        let tmpl = self.env.get_template("chat").map_err(|e| describe(&e))?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in args.extra {
            ctx.insert(k.clone(), v.clone());
        }
        let mut messages = args.messages;
        let mut final_text = None;
        if args.continue_final_message {
            let (tagged, text) = tag_final_message(&messages)?;
            messages = tagged;
            final_text = Some(text);
            if !self.source.contains("content") {
                return Err("continue_final_message is set to \"content\" but this is not an accepted field in the chat_template".into());
            }
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), args.tools.unwrap_or(Value::from(())));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert("add_generation_prompt".into(), Value::from(args.add_generation_prompt));
        let rendered = tmpl.render(Value::from(ctx)).map_err(|e| describe(&e))?;
        match final_text {
            None => Ok(rendered),
            Some(text) => cut_at_tag(rendered, &text),
        }
    }
}

/// The final message with the continue marker appended to its content (its last text part
/// when the content is a list), and the content before the marker.
fn tag_final_message(messages: &Value) -> Result<(Value, String), String> {
    let mut list: Vec<serde_json::Value> = serde_json::to_value(messages)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
        .ok_or("messages must be a list")?;
    let last = list.last_mut().ok_or("Cannot apply chat template to an empty conversation.")?;
    let missing = || "continue_final_message is set but the final message has no \"content\" to continue!".to_owned();
    let content = last.get_mut("content").filter(|c| !c.is_null()).ok_or_else(missing)?;
    let text = match content {
        serde_json::Value::String(s) => {
            let t = s.clone();
            s.push_str(CONTINUE_TAG);
            t
        }
        serde_json::Value::Array(parts) => {
            let part = parts
                .iter_mut()
                .rev()
                .find_map(|p| {
                    p.get_mut("text").and_then(|t| if let serde_json::Value::String(s) = t { Some(s) } else { None })
                })
                .ok_or(
                    "continue_final_message is set but we could not find any text to continue in the final message!",
                )?;
            let t = part.clone();
            part.push_str(CONTINUE_TAG);
            t
        }
        _ => return Err(missing()),
    };
    Ok((Value::from_serialize(&list), text))
}

/// Cuts the render where the marker is, as `transformers` does.
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, String> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err("continue_final_message is set but the final message does not appear in the chat after applying the chat template!".into());
    }
    let at = rendered.rfind(tag).unwrap_or(0);
    let head = rendered.get(..at).unwrap_or_default();
    if rendered.get(at..).is_some_and(|rest| rest.starts_with(CONTINUE_TAG)) {
        Ok(head.to_owned())
    } else {
        Ok(head.trim_end().to_owned())
    }
}

/// `{% generation %}` … `{% endgeneration %}` (assistant masks, which vLLM never asks for)
/// become a block that always renders its body, keeping their whitespace control.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let (head, tail) = rest.split_at(at);
        out.push_str(head);
        let Some(end) = tail.find("%}") else {
            out.push_str(tail);
            return out;
        };
        let tag = tail.get(..end.saturating_add(2)).unwrap_or(tail);
        let inner = tag.get(2..tag.len().saturating_sub(2)).unwrap_or_default();
        let lead = if inner.starts_with(['-', '+']) { inner.get(..1).unwrap_or_default() } else { "" };
        let trail = if inner.ends_with(['-', '+']) {
            inner.get(inner.len().saturating_sub(1)..).unwrap_or_default()
        } else {
            ""
        };
        let word = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        match word {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(tag),
        }
        rest = tail.get(tag.len()..).unwrap_or_default();
    }
    out.push_str(rest);
    out
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let mut style = JsonStyle::default();
    let mut positional = args.iter();
    let _ensure_ascii = positional.next();
    let indent: Option<Value> = match positional.next() {
        Some(v) => Some(v.clone()),
        None => kwargs.get("indent")?,
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if let Some(i) = indent.filter(|v| !v.is_none()) {
        style.indent = Some(match i.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(i64::try_from(i)?).unwrap_or(0).min(64)),
        });
    }
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let mut it = seps.try_iter()?;
        style.item_sep = it.next().and_then(|v| v.as_str().map(str::to_owned));
        style.key_sep = it.next().and_then(|v| v.as_str().map(str::to_owned));
    }
    json_dumps(&value, &style).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(format)` for the directives templates use.
fn strftime_now(format: String) -> Result<String, Error> {
    let now = time::OffsetDateTime::now_local().unwrap_or_else(|_| time::OffsetDateTime::now_utc());
    Ok(strftime(&now, &format))
}

/// Python's `strftime` for the C-locale directives; an unknown directive is kept as written.
pub fn strftime(t: &time::OffsetDateTime, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let month = MONTHS.get(usize::from(u8::from(t.month())).saturating_sub(1)).copied().unwrap_or("");
    let day = DAYS.get(usize::from(t.weekday().number_days_from_monday())).copied().unwrap_or("");
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let hour12 = match t.hour() % 12 {
            0 => 12,
            h => h,
        };
        let piece = match d {
            'Y' => t.year().to_string(),
            'y' => format!("{:02}", t.year().rem_euclid(100)),
            'm' => format!("{:02}", u8::from(t.month())),
            'd' => format!("{:02}", t.day()),
            'e' => format!("{:>2}", t.day()),
            'B' => month.to_owned(),
            'b' | 'h' => month.get(..3).unwrap_or("").to_owned(),
            'A' => day.to_owned(),
            'a' => day.get(..3).unwrap_or("").to_owned(),
            'H' => format!("{:02}", t.hour()),
            'I' => format!("{hour12:02}"),
            'M' => format!("{:02}", t.minute()),
            'S' => format!("{:02}", t.second()),
            'p' => (if t.hour() < 12 { "AM" } else { "PM" }).to_owned(),
            'j' => format!("{:03}", t.ordinal()),
            'Z' => "UTC".to_owned(),
            '%' => "%".to_owned(),
            other => format!("%{other}"),
        };
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(json: &str) -> Value {
        Value::from_serialize(serde_json::from_str::<serde_json::Value>(json).unwrap())
    }

    fn render(t: &str, m: &str, gen: bool, cont: bool) -> Result<String, String> {
        let tmpl = ChatTemplate::compile(t).unwrap();
        tmpl.render(RenderArgs {
            messages: msgs(m),
            tools: None,
            add_generation_prompt: gen,
            continue_final_message: cont,
            extra: &[],
        })
    }

    #[test]
    fn renders_as_jinja2_with_trim_and_lstrip_blocks() {
        let t = "{% for m in messages %}\n  <{{ m.role }}>{{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let out = render(t, r#"[{"role":"user","content":" hi "}]"#, true, false).unwrap();
        assert_eq!(out, "  <user>hi\n<assistant>", "as Jinja2 renders it");
    }

    #[test]
    fn prints_values_and_json_as_python_does() {
        let t = "{{ messages[0].x }}|{{ messages[0].b }}|{{ messages[0].n }}|{{ messages[0].x | tojson }}|{{ messages[0].x | tojson(indent=2) }}";
        let out = render(t, r#"[{"x":{"k":"v","l":[1,2]},"b":true,"n":null}]"#, false, false).unwrap();
        assert_eq!(out, "{'k': 'v', 'l': [1, 2]}|True|None|{\"k\": \"v\", \"l\": [1, 2]}|{\n  \"k\": \"v\",\n  \"l\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn python_string_methods_and_raise_exception() {
        let t = "{% if messages[0].content.startswith('a') %}{{ messages[0].content.strip().upper() }}{% else %}{{ raise_exception('must start with a') }}{% endif %}";
        assert_eq!(render(t, r#"[{"content":"ab "}]"#, false, false).unwrap(), "AB");
        assert!(render(t, r#"[{"content":"b"}]"#, false, false).unwrap_err().contains("must start with a"));
    }

    #[test]
    fn continue_final_message_cuts_after_the_final_content() {
        let t = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}";
        let out =
            render(t, r#"[{"role":"user","content":"q"},{"role":"assistant","content":"The answer is"}]"#, false, true)
                .unwrap();
        assert_eq!(out, "<user>q</s>\n<assistant>The answer is");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let t = "{% for m in messages %}{% generation %}{{ m.content }}{%- endgeneration %}{% endfor %}";
        assert_eq!(render(t, r#"[{"content":"a"},{"content":"b"}]"#, false, false).unwrap(), "ab");
    }

    #[test]
    fn strftime_writes_python_directives() {
        let t = time::macros::datetime!(2026-03-05 14:07:09 UTC);
        assert_eq!(strftime(&t, "%d %b %Y, %A %H:%M %p %%"), "05 Mar 2026, Thursday 14:07 PM %");
    }
}
