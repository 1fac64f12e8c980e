//! A chat request's messages turned into the conversation vLLM 0.33 hands to the chat
//! template: text parts joined or kept as parts (the template's content format), assistant
//! tool-call arguments parsed into objects, tool results flattened, `developer` turned into
//! `system` where the template knows no developer role. Media parts are declined: only the
//! engine's renderer knows their placeholders and feature hashes.

use crate::error::RequestError;
use serde_json::{Map, Value as Json};

/// How a template reads message content (vLLM's `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with newlines into one string.
    String,
    /// A list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

/// Claude Code's attribution header line, dropped from system text by vLLM.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Messages at most per request (each costs template work).
pub const MAX_MESSAGES: usize = 10_000;

/// The conversation for `messages`.
pub fn conversation(messages: &Json, format: ContentFormat, developer_role: bool) -> Result<Vec<Json>, RequestError> {
    let Json::Array(list) = messages else {
        return Err(RequestError::BadRequest("`messages` must be a list".into()));
    };
    if list.is_empty() {
        return Err(RequestError::BadRequest("Cannot apply chat template to an empty conversation.".into()));
    }
    if list.len() > MAX_MESSAGES {
        return Err(RequestError::BadRequest(format!("more than {MAX_MESSAGES} messages")));
    }
    let mut out = Vec::with_capacity(list.len());
    for m in list {
        out.push(message(m, format)?);
    }
    postprocess_tool_calls(&mut out)?;
    if !developer_role && out.iter().any(|m| m.get("role").and_then(Json::as_str) == Some("developer")) {
        out = consolidate_system(developer_to_system(out));
    }
    Ok(out)
}

fn message(m: &Json, format: ContentFormat) -> Result<Json, RequestError> {
    let Json::Object(obj) = m else {
        return Err(RequestError::BadRequest("each message must be an object".into()));
    };
    let role = obj
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| RequestError::BadRequest("each message needs a string `role`".into()))?;
    let mut texts = Vec::new();
    match obj.get("content") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => texts.push(s.clone()),
        Some(Json::Array(parts)) => {
            for p in parts {
                if let Some(t) = text_of(p)? {
                    texts.push(t);
                }
            }
        }
        Some(_) => return Err(RequestError::BadRequest("`content` must be a string or a list of parts".into())),
    }
    if role == "system" {
        texts = strip_billing_header(texts);
    }
    let mut out = Map::new();
    out.insert("role".into(), Json::String(role.to_owned()));
    let content = match format {
        ContentFormat::OpenAi => Json::Array(
            texts
                .iter()
                .map(|t| {
                    let mut part = Map::new();
                    part.insert("type".into(), Json::String("text".into()));
                    part.insert("text".into(), Json::String(t.clone()));
                    Json::Object(part)
                })
                .collect(),
        ),
        ContentFormat::String => Json::String(texts.join("\n")),
    };
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), calls.clone());
            }
            if let Some(r) = obj.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "tool" => {
            if let Some(id) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
            if let Some(Json::Array(parts)) = out.get("content") {
                let joined: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect();
                let joined = joined.join("\n");
                out.insert("content".into(), Json::String(joined));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = obj.get(key).filter(|v| v.is_string()) {
            out.insert(key.into(), v.clone());
        }
    }
    if role == "developer" {
        out.insert("tools".into(), obj.get("tools").cloned().unwrap_or(Json::Null));
    }
    Ok(Json::Object(out))
}

/// A content part's text; media parts are declined.
fn text_of(p: &Json) -> Result<Option<String>, RequestError> {
    match p {
        Json::String(s) => Ok(Some(s.clone())),
        Json::Object(o) => match o.get("type").and_then(Json::as_str) {
            Some("text") | Some("input_text") | Some("output_text") => match o.get("text") {
                Some(Json::String(s)) => Ok(Some(s.clone())),
                _ => Err(RequestError::BadRequest("a text part needs a string `text`".into())),
            },
            Some("refusal") => Ok(o.get("refusal").and_then(Json::as_str).map(str::to_owned)),
            Some(other) => Err(RequestError::Declined(format!("content part of type `{other}`"))),
            None => Err(RequestError::BadRequest("a content part needs a `type`".into())),
        },
        _ => Err(RequestError::BadRequest("a content part must be an object or a string".into())),
    }
}

fn strip_billing_header(texts: Vec<String>) -> Vec<String> {
    texts
        .into_iter()
        .filter_map(|t| {
            if !t.starts_with(BILLING_HEADER) {
                return Some(t);
            }
            let rest = t.split_once('\n').map(|(_, r)| r.to_owned()).unwrap_or_default();
            (!rest.is_empty()).then_some(rest)
        })
        .collect()
}

/// Assistant tool calls: arguments as objects (a JSON string parsed, anything else `{}`),
/// an empty list dropped.
fn postprocess_tool_calls(messages: &mut [Json]) -> Result<(), RequestError> {
    for m in messages.iter_mut() {
        if m.get("role").and_then(Json::as_str) != Some("assistant") {
            continue;
        }
        let Some(obj) = m.as_object_mut() else { continue };
        let Some(Json::Array(calls)) = obj.get_mut("tool_calls") else { continue };
        if calls.is_empty() {
            obj.remove("tool_calls");
            continue;
        }
        for call in calls.iter_mut() {
            let Json::Object(call) = call else {
                return Err(RequestError::BadRequest("assistant tool_calls entries must be objects.".into()));
            };
            let is_function = call.get("type").and_then(Json::as_str).unwrap_or("function") == "function";
            let Some(Json::Object(function)) = call.get_mut("function").filter(|_| is_function) else {
                return Err(RequestError::BadRequest(
                    "chat completions only support assistant tool_calls of type 'function'.".into(),
                ));
            };
            let parsed = match function.get("arguments") {
                Some(Json::Object(o)) if !o.is_empty() => Json::Object(o.clone()),
                Some(Json::String(s)) if !s.is_empty() => match serde_json::from_str::<Json>(s) {
                    Ok(Json::Object(o)) => Json::Object(o),
                    _ => Json::Object(Map::new()),
                },
                Some(v) if truthy(v) => match v {
                    Json::Object(_) => v.clone(),
                    _ => Json::Object(Map::new()),
                },
                _ => Json::Object(Map::new()),
            };
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

fn developer_to_system(messages: Vec<Json>) -> Vec<Json> {
    messages
        .into_iter()
        .map(|mut m| {
            if let Some(o) = m.as_object_mut().filter(|o| o.get("role").and_then(Json::as_str) == Some("developer")) {
                o.insert("role".into(), Json::String("system".into()));
                o.remove("tools");
            }
            m
        })
        .collect()
}

/// All system messages merged into one at the front, when one is not first or there are
/// several.
fn consolidate_system(messages: Vec<Json>) -> Vec<Json> {
    let mut contents = Vec::new();
    let mut rest = Vec::new();
    let mut needed = false;
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Json::as_str) == Some("system") {
            if i > 0 || !contents.is_empty() {
                needed = true;
            }
            let text = match m.get("content") {
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Json::as_str).or_else(|| p.as_str()))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !text.is_empty() {
                contents.push(text);
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !needed {
        return messages;
    }
    let mut merged = Map::new();
    merged.insert("role".into(), Json::String("system".into()));
    merged.insert("content".into(), Json::String(contents.join("\n\n")));
    let mut out = vec![Json::Object(merged)];
    out.extend(rest);
    out
}

/// Whether the template supports a `developer` role (vLLM looks for the quoted word).
pub fn supports_developer_role(template: &str) -> bool {
    template.contains("\"developer\"") || template.contains("'developer'")
}

/// The content format a template reads, as vLLM detects it: `openai` when a loop iterates
/// over a message's `content` (or a variable named `content`), else `string`.
pub fn detect_content_format(template: &str) -> ContentFormat {
    let mut rest = template;
    while let Some(at) = rest.find("{%") {
        let tail = rest.get(at.saturating_add(2)..).unwrap_or_default();
        let end = tail.find("%}").unwrap_or(tail.len());
        let inner =
            tail.get(..end).unwrap_or_default().trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(spec) = inner.strip_prefix("for ") {
            if let Some((_, iter)) = spec.split_once(" in ") {
                let iter = iter.split(" if ").next().unwrap_or_default();
                let iter = iter.split('|').next().unwrap_or_default().trim();
                let iter = iter.trim_start_matches('(').trim_end_matches(')').trim();
                if iter == "content"
                    || iter.ends_with(".content")
                    || iter.ends_with("['content']")
                    || iter.ends_with("[\"content\"]")
                {
                    return ContentFormat::OpenAi;
                }
            }
        }
        rest = tail.get(end..).unwrap_or_default();
    }
    ContentFormat::String
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_are_joined_or_kept_by_content_format() {
        let m = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
        assert_eq!(
            conversation(&m, ContentFormat::String, true).unwrap(),
            vec![json!({"role": "user", "content": "a\nb"})]
        );
        let m = json!([{"role": "user", "content": "a"}]);
        assert_eq!(
            conversation(&m, ContentFormat::OpenAi, true).unwrap(),
            vec![json!({"role": "user", "content": [{"type": "text", "text": "a"}]})]
        );
    }

    #[test]
    fn media_parts_are_declined_and_malformed_messages_refused() {
        let m = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        assert!(matches!(conversation(&m, ContentFormat::String, true), Err(RequestError::Declined(_))));
        assert!(matches!(
            conversation(&json!([{"content": "x"}]), ContentFormat::String, true),
            Err(RequestError::BadRequest(_))
        ));
        assert!(matches!(conversation(&json!([]), ContentFormat::String, true), Err(RequestError::BadRequest(_))));
    }

    #[test]
    fn tool_call_arguments_become_objects() {
        let m = json!([{"role": "assistant", "content": null, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]}]);
        let c = conversation(&m, ContentFormat::String, true).unwrap();
        assert_eq!(c[0]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(c[0]["tool_calls"][1]["function"]["arguments"], json!({}));
        assert_eq!(c[0]["content"], json!(""));
    }

    #[test]
    fn developer_becomes_system_where_the_template_has_no_developer_role() {
        let m = json!([{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]);
        let c = conversation(&m, ContentFormat::String, false).unwrap();
        assert_eq!(c, vec![json!({"role": "system", "content": "s\n\nd"}), json!({"role": "user", "content": "u"})]);
    }

    #[test]
    fn content_format_is_detected_from_loops_over_content() {
        assert_eq!(detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}"), ContentFormat::String);
        assert_eq!(
            detect_content_format(
                "{% for m in messages %}{%- for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
    }
}
