//! Field-addressed validation errors.
//!
//! Every problem found in a configuration is a [`FieldError`] naming the field it is about.
//! Paths use dotted field names, `[i]` for list indexes and `[key]` for map keys, for example
//! `sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[GPU-xyz]`. An empty path means the
//! value as a whole. Validation collects all problems into [`Errors`] instead of stopping at
//! the first, so one round trip shows a user everything to fix.

use std::fmt;

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub struct FieldError {
    /// Where the problem is (`sharing.strategy`); empty for the value as a whole.
    pub path: String,
    /// What is wrong and what would be valid, lowercase, no trailing period.
    pub message: String,
}

impl FieldError {
    /// A problem at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }

    /// The same problem seen from a containing value: `prefix` is prepended to the path.
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.path = join(prefix, &self.path);
        self
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// All problems found in one value, in the order they were found (never empty when returned
/// as an error).
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
pub struct Errors(pub Vec<FieldError>);

impl Errors {
    /// No problems yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a problem at `path`.
    pub fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError::new(path, message));
    }

    /// True when no problem was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Number of problems.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The problems in order.
    pub fn iter(&self) -> std::slice::Iter<'_, FieldError> {
        self.0.iter()
    }

    /// `Ok(value)` when nothing was recorded, else `Err(self)`.
    pub fn into_result<T>(self, value: T) -> Result<T, Errors> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(self)
        }
    }

    /// The same problems seen from a containing value (see [`FieldError::with_prefix`]).
    pub fn with_prefix(self, prefix: &str) -> Self {
        Self(self.0.into_iter().map(|e| e.with_prefix(prefix)).collect())
    }
}

impl fmt::Display for Errors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl IntoIterator for Errors {
    type Item = FieldError;
    type IntoIter = std::vec::IntoIter<FieldError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a Errors {
    type Item = &'a FieldError;
    type IntoIter = std::slice::Iter<'a, FieldError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl From<FieldError> for Errors {
    fn from(e: FieldError) -> Self {
        Self(vec![e])
    }
}

/// Joins a parent path and a child path (`a.b` + `c` = `a.b.c`; `a` + `[0]` = `a[0]`).
pub(crate) fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_owned()
    } else if child.is_empty() {
        parent.to_owned()
    } else if child.starts_with('[') {
        format!("{parent}{child}")
    } else {
        format!("{parent}.{child}")
    }
}

/// `parent[index]`.
pub(crate) fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// Suggests the candidate a user most likely meant by `input`: the same word ignoring case and
/// `-`, `_`, `.` and spaces, else one within edit distance 2. `None` when nothing is close.
pub fn suggest<'a>(input: &str, candidates: &[&'a str]) -> Option<&'a str> {
    fn squash(s: &str) -> String {
        s.chars()
            .filter(|c| !matches!(c, '-' | '_' | '.' | ' '))
            .flat_map(char::to_lowercase)
            .collect()
    }
    let wanted = squash(input);
    if let Some(c) = candidates.iter().find(|c| squash(c) == wanted) {
        return Some(c);
    }
    // Edit distance is quadratic: only worth it (and only meaningful) for short inputs.
    if input.len() > 64 {
        return None;
    }
    candidates
        .iter()
        .map(|c| (levenshtein(&wanted, &squash(c)), *c))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// `did you mean "X"? ` when a suggestion exists, else empty.
pub fn did_you_mean(input: &str, candidates: &[&str]) -> String {
    suggest(input, candidates)
        .map(|s| format!("did you mean \"{s}\"? "))
        .unwrap_or_default()
}

/// `"a", "b" or "c"` for messages listing what is valid.
pub(crate) fn one_of(candidates: &[&str]) -> String {
    let quoted: Vec<String> = candidates.iter().map(|c| format!("\"{c}\"")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_path_colon_message_one_per_line() {
        let mut errs = Errors::new();
        errs.push("sharing.strategy", "required");
        errs.push("", "must be an object");
        assert_eq!(
            errs.to_string(),
            "sharing.strategy: required\nmust be an object"
        );
    }

    #[test]
    fn prefixes_join_fields_and_indexes() {
        let e = FieldError::new("sharing.strategy", "x").with_prefix("spec.config[0]");
        assert_eq!(e.path, "spec.config[0].sharing.strategy");
        let e = FieldError::new("[3]", "x").with_prefix("a.b");
        assert_eq!(e.path, "a.b[3]");
        let e = FieldError::new("", "x").with_prefix("a.b");
        assert_eq!(e.path, "a.b");
    }

    #[test]
    fn suggestions_catch_near_misses_only() {
        let c = &["TimeSlicing", "MPS"];
        for input in ["Time-Slicing", "timeslicing", "time_slicing", "TimeSlcing"] {
            assert_eq!(suggest(input, c), Some("TimeSlicing"), "{input}");
        }
        for input in ["mps", "Mps", "MSP"] {
            assert_eq!(suggest(input, c), Some("MPS"), "{input}");
        }
        assert_eq!(suggest("Exclusive", c), None);
        assert_eq!(suggest(&"x".repeat(100), c), None);
    }

    #[test]
    fn one_of_lists_quoted() {
        assert_eq!(one_of(&["a"]), "\"a\"");
        assert_eq!(one_of(&["a", "b", "c"]), "\"a\", \"b\" or \"c\"");
    }
}
