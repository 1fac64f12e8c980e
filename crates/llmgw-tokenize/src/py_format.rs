//! Values written the way Python writes them, for chat templates written against Jinja2:
//! `json.dumps` as Hugging Face's `tojson` filter calls it (`ensure_ascii=False`, `", "` and
//! `": "` separators, optional indent, optional sorted keys) and `str()` of a value printed
//! with `{{ value }}` (`True`, `None`, `{'a': 1}`).
//!
//! Kept here rather than taken from a library: serde_json writes compact JSON (`{"a":1}`) and
//! minijinja prints its own forms (`true`, `none`, `{"a": 1}`); a template that prints either
//! would render other text than vLLM's and so other tokens.

use minijinja::value::{Value, ValueKind};
use std::fmt::Write;

/// Options of Python's `json.dumps` that templates pass to `tojson`.
#[derive(Debug, Clone, Default)]
pub struct JsonStyle {
    pub indent: Option<String>,
    pub item_sep: Option<String>,
    pub key_sep: Option<String>,
    pub sort_keys: bool,
}

/// `json.dumps(value, ensure_ascii=False, ...)`. Values JSON cannot hold (undefined, functions)
/// are an error, as they are in Python.
pub fn json_dumps(v: &Value, style: &JsonStyle) -> Result<String, String> {
    let mut out = String::new();
    write_json(&mut out, v, style, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), String> {
    if depth > 128 {
        return Err("value nested too deeply for tojson".into());
    }
    let item_sep = style.item_sep.as_deref().unwrap_or(if style.indent.is_some() { "," } else { ", " });
    let key_sep = style.key_sep.as_deref().unwrap_or(": ");
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => return Err("undefined is not JSON serializable".into()),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, style, depth.saturating_add(1));
                write_json(out, item, style, depth.saturating_add(1))?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, style, depth.saturating_add(1));
                match k.kind() {
                    ValueKind::String => write_json_str(out, k.as_str().unwrap_or_default()),
                    ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                        let mut s = String::new();
                        write_json(&mut s, k, style, depth.saturating_add(1))?;
                        write_json_str(out, &s);
                    }
                    _ => return Err("keys must be str, int, float, bool or None".into()),
                }
                out.push_str(key_sep);
                let item = v.get_item(k).map_err(|e| e.to_string())?;
                write_json(out, &item, style, depth.saturating_add(1))?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        _ => return Err(format!("a {} is not JSON serializable", v.kind())),
    }
    Ok(())
}

fn newline(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// A JSON string with `ensure_ascii=False`: only `"`, `\` and control characters escaped.
fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python prints it (integers as such, floats by `repr`).
fn write_number(out: &mut String, v: &Value) {
    if let Ok(i) = i64::try_from(v.clone()) {
        if !is_float(v) {
            let _ = write!(out, "{i}");
            return;
        }
    }
    if let Ok(f) = f64::try_from(v.clone()) {
        out.push_str(&float_repr(f));
        return;
    }
    let _ = write!(out, "{v}");
}

fn is_float(v: &Value) -> bool {
    // minijinja keeps floats and integers apart; a float's own rendering has a '.', 'e', "inf" or "NaN".
    let s = v.to_string();
    s.contains('.') || s.contains('e') || s.contains("inf") || s.contains("NaN")
}

/// Python's `repr(float)`: the shortest round-trip digits, `1.0` not `1`, exponents as `1e-05`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Scientific: mantissa digits as Rust's shortest form, exponent with sign and 2+ digits.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.unsigned_abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// What `{{ value }}` prints in Jinja2 (Python's `str()`): strings as they are, everything
/// else by [`py_repr`].
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or_default().to_owned(),
        ValueKind::Undefined => String::new(),
        _ => {
            let mut out = String::new();
            py_repr(&mut out, v, 0);
            out
        }
    }
}

/// Python's `repr()` of a JSON-like value.
fn py_repr(out: &mut String, v: &Value, depth: usize) {
    if depth > 128 {
        out.push_str("...");
        return;
    }
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if is_float(v) => match f64::try_from(v.clone()) {
            Ok(f) if f.is_nan() => out.push_str("nan"),
            Ok(f) if f.is_infinite() => out.push_str(if f > 0.0 { "inf" } else { "-inf" }),
            Ok(f) => out.push_str(&float_repr(f)),
            Err(_) => {
                let _ = write!(out, "{v}");
            }
        },
        ValueKind::String => py_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(it) = v.try_iter() {
                for (i, item) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item, depth.saturating_add(1));
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(it) = v.try_iter() {
                for (i, k) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &k, depth.saturating_add(1));
                    out.push_str(": ");
                    let item = v.get_item(&k).unwrap_or_default();
                    py_repr(out, &item, depth.saturating_add(1));
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a `'` and no `"`.
fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        Value::from_serialize(serde_json::from_str::<serde_json::Value>(json).unwrap_or_default())
    }

    #[test]
    fn json_dumps_writes_what_python_writes() {
        let d = JsonStyle::default();
        assert_eq!(
            json_dumps(&v(r#"{"b": [1, 2.5, "é\n"], "a": null, "c": true}"#), &d).ok(),
            Some(r#"{"b": [1, 2.5, "é\n"], "a": null, "c": true}"#.to_owned())
        );
        let sorted = JsonStyle { sort_keys: true, ..JsonStyle::default() };
        assert_eq!(json_dumps(&v(r#"{"b": 1, "a": 2}"#), &sorted).ok(), Some(r#"{"a": 2, "b": 1}"#.to_owned()));
        let indented = JsonStyle { indent: Some("  ".into()), ..JsonStyle::default() };
        assert_eq!(
            json_dumps(&v(r#"{"a": [1], "b": {}}"#), &indented).ok(),
            Some("{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}".to_owned())
        );
        assert_eq!(json_dumps(&v("1e-5"), &d).ok(), Some("1e-05".to_owned()));
        assert_eq!(json_dumps(&v("3.0"), &d).ok(), Some("3.0".to_owned()));
    }

    #[test]
    fn str_prints_what_python_prints() {
        assert_eq!(py_str(&v(r#"{"a": [true, null, "it's"], "b": 1.0}"#)), r#"{'a': [True, None, "it's"], 'b': 1.0}"#);
        assert_eq!(py_str(&v("\"plain\"")), "plain");
        assert_eq!(py_str(&Value::from(false)), "False");
    }
}
