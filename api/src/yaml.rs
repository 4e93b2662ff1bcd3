//! YAML reading with one-line, positioned errors.
//!
//! Wraps serde-saphyr so that callers (the CLI, [`crate::decode_yaml`]) get the same error
//! shape whatever the parser's message style, and no parser type leaks into our public API.
//! Duplicate mapping keys are errors, as in Kubernetes' strict decoding.

use serde_json::Value;

/// A YAML document that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", position(*.line, *.column))]
pub struct YamlError {
    /// 1-based line, 0 when unknown.
    pub line: u64,
    /// 1-based column, 0 when unknown.
    pub column: u64,
    /// What the parser said, on one line, without the position.
    pub message: String,
}

fn position(line: u64, column: u64) -> String {
    if line == 0 {
        String::new()
    } else {
        format!("line {line} column {column}: ")
    }
}

impl From<serde_saphyr::Error> for YamlError {
    fn from(e: serde_saphyr::Error) -> Self {
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let shown = e.without_snippet().to_string();
        let mut message = shown.lines().next().unwrap_or_default();
        message = message.strip_prefix("error: ").unwrap_or(message);
        // The position is kept in fields; drop the parser's own rendering of it.
        if let Some((pos, rest)) = message.split_once(": ")
            && pos.starts_with("line ")
        {
            message = rest;
        }
        if let Some(i) = message.rfind(" at line ") {
            message = &message[..i];
        }
        YamlError {
            line,
            column,
            message: message.to_owned(),
        }
    }
}

/// Parses one YAML (or JSON) document.
pub fn from_str(text: &str) -> Result<Value, YamlError> {
    Ok(serde_saphyr::from_str(text)?)
}

/// Parses every document of a multi-document YAML stream; empty documents are dropped.
pub fn from_multiple(text: &str) -> Result<Vec<Value>, YamlError> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text)?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_one_line_with_position() {
        for (text, line, column) in [
            ("a: [unclosed\n", 1, 4),
            ("apiVersion: [unclosed\nkind: GpuConfig\n", 2, 5),
            ("a: 1\nb: 2\na: 3\n", 3, 1),
            ("key: value\n  bad: x\n", 2, 6),
        ] {
            let e = from_multiple(text).unwrap_err();
            assert_eq!((e.line, e.column), (line, column), "{text:?}: {e}");
            assert!(!e.message.is_empty() && !e.message.contains('\n'), "{e:?}");
            assert!(!e.message.contains("line "), "{e:?}");
            assert!(
                e.to_string()
                    .starts_with(&format!("line {line} column {column}: "))
            );
        }
    }

    #[test]
    fn documents_are_split_and_empty_ones_dropped() {
        let docs = from_multiple("---\na: 1\n---\n---\n- 2\n").unwrap();
        assert_eq!(docs, [serde_json::json!({"a": 1}), serde_json::json!([2])]);
        assert_eq!(from_str("{\"a\": 1}").unwrap(), serde_json::json!({"a": 1}));
    }
}
