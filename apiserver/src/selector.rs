//! Label and field selectors: parsing the Kubernetes string syntax into a small AST that the
//! store turns into SQL and the watch path evaluates in memory.
//!
//! Grammar (k8s.io/apimachinery/pkg/labels): comma-separated requirements, each one of
//! `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`.
//! Field selectors support `metadata.name` and `metadata.namespace` with `=`, `==` and `!=`,
//! which is what CRD storage supports too.

use std::collections::BTreeMap;
use std::fmt;

/// Requirements of one label selector. Each becomes a term of the SQL condition and a check on
/// every watched change; SQLite refuses conditions past about a thousand nested terms, so the
/// limit is well below (and far above any real selector: Kyverno's use two).
pub const MAX_LABEL_REQUIREMENTS: usize = 100;
/// Values of all `in`/`notin` sets of one label selector, each a bind parameter.
pub const MAX_LABEL_VALUES: usize = 1_000;
/// Requirements of one field selector (only `metadata.name` and `metadata.namespace` exist).
pub const MAX_FIELD_REQUIREMENTS: usize = 20;

/// One requirement of a label selector.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector; an empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LabelSelector(pub Vec<Requirement>);

/// A parsed field selector over the fields CRD storage supports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FieldSelector(pub Vec<FieldRequirement>);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FieldRequirement {
    pub field: Field,
    pub value: String,
    pub equal: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    Name,
    Namespace,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("unable to parse requirement {0:?}: {1}")]
    Syntax(String, &'static str),
    #[error(
        "invalid label key {0:?}: a key is an optional DNS prefix and '/', then 1-63 characters of [A-Za-z0-9_.-] starting and ending with an alphanumeric"
    )]
    InvalidKey(String),
    #[error(
        "invalid label value {0:?}: at most 63 characters of [A-Za-z0-9_.-], starting and ending with an alphanumeric"
    )]
    InvalidValue(String),
    #[error("field label not supported: {0} (supported: metadata.name, metadata.namespace)")]
    UnsupportedField(String),
    #[error("too many {what}: {count} (at most {max} per selector)")]
    TooLarge {
        what: &'static str,
        count: usize,
        max: usize,
    },
}

fn at_most(what: &'static str, count: usize, max: usize) -> Result<(), SelectorError> {
    if count > max {
        return Err(SelectorError::TooLarge { what, count, max });
    }
    Ok(())
}

fn valid_name_part(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

fn valid_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => {
            prefix.len() <= 253
                && prefix
                    .split('.')
                    .all(|p| valid_name_part(p, 63) && !p.contains('_'))
                && valid_name_part(name, 63)
        }
        None => valid_name_part(key, 63),
    }
}

fn valid_value(value: &str) -> bool {
    value.is_empty() || valid_name_part(value, 63)
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn parse_set(raw: &str, rest: &str) -> Result<Vec<String>, SelectorError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| {
            SelectorError::Syntax(raw.to_owned(), "expected a parenthesised set of values")
        })?;
    let mut values: Vec<String> = inner.split(',').map(|v| v.trim().to_owned()).collect();
    if values.len() == 1 && values[0].is_empty() {
        return Err(SelectorError::Syntax(
            raw.to_owned(),
            "a set needs at least one value",
        ));
    }
    for v in &values {
        if !valid_value(v) {
            return Err(SelectorError::InvalidValue(v.clone()));
        }
    }
    values.sort();
    values.dedup();
    Ok(values)
}

impl LabelSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let input = input.trim();
        if input.is_empty() {
            return Ok(Self::default());
        }
        let parts = split_top_level(input);
        at_most("requirements", parts.len(), MAX_LABEL_REQUIREMENTS)?;
        let mut reqs = Vec::new();
        let mut values = 0;
        for raw in parts {
            let part = raw.trim();
            if part.is_empty() {
                return Err(SelectorError::Syntax(input.to_owned(), "empty requirement"));
            }
            let req = if let Some(key) = part.strip_prefix('!') {
                Requirement::NotExists(Self::key(key.trim())?)
            } else if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotIn(Self::key(key.trim())?, vec![Self::value(value.trim())?])
            } else if let Some((key, value)) =
                part.split_once("==").or_else(|| part.split_once('='))
            {
                Requirement::In(Self::key(key.trim())?, vec![Self::value(value.trim())?])
            } else if let Some((key, rest)) = split_word(part, "notin") {
                Requirement::NotIn(Self::key(key)?, parse_set(part, rest)?)
            } else if let Some((key, rest)) = split_word(part, "in") {
                Requirement::In(Self::key(key)?, parse_set(part, rest)?)
            } else if part.contains(|c: char| c.is_whitespace() || "()<>".contains(c)) {
                return Err(SelectorError::Syntax(part.to_owned(), "unknown operator"));
            } else {
                Requirement::Exists(Self::key(part)?)
            };
            if let Requirement::In(_, set) | Requirement::NotIn(_, set) = &req {
                values += set.len();
                at_most("values", values, MAX_LABEL_VALUES)?;
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    fn key(key: &str) -> Result<String, SelectorError> {
        if valid_key(key) {
            Ok(key.to_owned())
        } else {
            Err(SelectorError::InvalidKey(key.to_owned()))
        }
    }

    fn value(value: &str) -> Result<String, SelectorError> {
        if valid_value(value) {
            Ok(value.to_owned())
        } else {
            Err(SelectorError::InvalidValue(value.to_owned()))
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
        })
    }
}

/// `key <word> (set)` with whitespace around the word.
fn split_word<'a>(part: &'a str, word: &str) -> Option<(&'a str, &'a str)> {
    let mut search = part;
    let mut offset = 0;
    while let Some(i) = search.find(word) {
        let abs = offset + i;
        let before = part[..abs].chars().last();
        let after = part[abs + word.len()..].chars().next();
        if before.is_some_and(char::is_whitespace)
            && after.is_some_and(|c| c.is_whitespace() || c == '(')
        {
            return Some((part[..abs].trim(), &part[abs + word.len()..]));
        }
        offset = abs + word.len();
        search = &part[offset..];
    }
    None
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|r| match r {
                Requirement::Exists(k) => k.clone(),
                Requirement::NotExists(k) => format!("!{k}"),
                Requirement::In(k, v) if v.len() == 1 => format!("{k}={}", v[0]),
                Requirement::NotIn(k, v) if v.len() == 1 => format!("{k}!={}", v[0]),
                Requirement::In(k, v) => format!("{k} in ({})", v.join(",")),
                Requirement::NotIn(k, v) => format!("{k} notin ({})", v.join(",")),
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl FieldSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let input = input.trim();
        if input.is_empty() {
            return Ok(Self::default());
        }
        let parts: Vec<&str> = input.split(',').collect();
        at_most("requirements", parts.len(), MAX_FIELD_REQUIREMENTS)?;
        let mut reqs = Vec::new();
        for part in parts {
            let part = part.trim();
            let (field, value, equal) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (f, v, true)
            } else {
                return Err(SelectorError::Syntax(
                    part.to_owned(),
                    "expected field=value or field!=value",
                ));
            };
            let field = match field.trim() {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
                other => return Err(SelectorError::UnsupportedField(other.to_owned())),
            };
            reqs.push(FieldRequirement {
                field,
                value: value.trim().to_owned(),
                equal,
            });
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The selector of a watch on one object (`…/policyreports/{name}?watch=1`), as
    /// kube-apiserver makes it: the name as given, never parsed as selector syntax, and a
    /// `fieldSelector` that pins another name is refused.
    pub fn for_named_watch(self, name: &str) -> Result<Self, SelectorError> {
        if self.is_empty() {
            return Ok(Self(vec![FieldRequirement {
                field: Field::Name,
                value: name.to_owned(),
                equal: true,
            }]));
        }
        match self.pinned(Field::Name) {
            Some(pinned) if pinned == name => Ok(self),
            _ => Err(SelectorError::Syntax(
                self.to_string(),
                "the fieldSelector's metadata.name does not match the requested name",
            )),
        }
    }

    pub fn matches(&self, namespace: &str, name: &str) -> bool {
        self.0.iter().all(|r| {
            let actual = match r.field {
                Field::Name => name,
                Field::Namespace => namespace,
            };
            (actual == r.value) == r.equal
        })
    }

    /// The single name an equality requirement pins, if any (lets the store use the key index).
    pub fn pinned(&self, field: Field) -> Option<&str> {
        self.0
            .iter()
            .find(|r| r.field == field && r.equal)
            .map(|r| r.value.as_str())
    }
}

impl fmt::Display for FieldSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|r| {
                let field = match r.field {
                    Field::Name => "metadata.name",
                    Field::Namespace => "metadata.namespace",
                };
                format!("{field}{}{}", if r.equal { "=" } else { "!=" }, r.value)
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_operator() {
        let s = LabelSelector::parse("a=1,b==2,c!=3,d in (x, y),e notin (z),f,!g").unwrap();
        assert_eq!(
            s.0,
            vec![
                Requirement::In("a".into(), vec!["1".into()]),
                Requirement::In("b".into(), vec!["2".into()]),
                Requirement::NotIn("c".into(), vec!["3".into()]),
                Requirement::In("d".into(), vec!["x".into(), "y".into()]),
                Requirement::NotIn("e".into(), vec!["z".into()]),
                Requirement::Exists("f".into()),
                Requirement::NotExists("g".into()),
            ]
        );
        let l = labels(&[("a", "1"), ("b", "2"), ("d", "y"), ("f", "")]);
        assert!(s.matches(&l));
        assert!(!s.matches(&labels(&[("a", "1")])));
    }

    #[test]
    fn prefixed_keys_and_empty_values() {
        let s =
            LabelSelector::parse("audit.kyverno.io/resource.uid=abc,app.kubernetes.io/managed-by=")
                .unwrap();
        assert!(s.matches(&labels(&[
            ("audit.kyverno.io/resource.uid", "abc"),
            ("app.kubernetes.io/managed-by", "")
        ])));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "a b", "a in x", "a in ()", "=x", "a=b c", "-a=1", "a=(", "a,,b", "x notin",
        ] {
            assert!(
                LabelSelector::parse(bad).is_err(),
                "{bad:?} should not parse"
            );
        }
        assert!(FieldSelector::parse("spec.x=1").is_err());
    }

    #[test]
    fn field_selectors() {
        let f = FieldSelector::parse("metadata.name=x,metadata.namespace!=kube-system").unwrap();
        assert!(f.matches("default", "x"));
        assert!(!f.matches("kube-system", "x"));
        assert_eq!(f.pinned(Field::Name), Some("x"));
        assert_eq!(
            f.to_string(),
            "metadata.name=x,metadata.namespace!=kube-system"
        );
    }

    fn key() -> impl Strategy<Value = String> {
        "([a-z]{1,5}\\.){0,2}[a-z]{1,5}/[a-z][a-z0-9]{0,6}|[a-z][a-z0-9_.-]{0,6}[a-z0-9]"
    }
    fn value() -> impl Strategy<Value = String> {
        "|[a-z0-9]([a-z0-9_.-]{0,6}[a-z0-9])?"
    }
    fn requirement() -> impl Strategy<Value = Requirement> {
        prop_oneof![
            key().prop_map(Requirement::Exists),
            key().prop_map(Requirement::NotExists),
            (
                key(),
                proptest::collection::btree_set("[a-z0-9]{1,4}", 1..4)
            )
                .prop_map(|(k, v)| Requirement::In(k, v.into_iter().collect())),
            (
                key(),
                proptest::collection::btree_set("[a-z0-9]{1,4}", 1..4)
            )
                .prop_map(|(k, v)| Requirement::NotIn(k, v.into_iter().collect())),
            (key(), value()).prop_map(|(k, v)| Requirement::In(k, vec![v])),
        ]
    }

    proptest! {
        #[test]
        fn display_then_parse_round_trips(reqs in proptest::collection::vec(requirement(), 1..5)) {
            let selector = LabelSelector(reqs);
            let printed = selector.to_string();
            prop_assert_eq!(LabelSelector::parse(&printed).unwrap(), selector);
        }

        #[test]
        fn parse_never_panics(input in ".{0,40}") {
            let _ = LabelSelector::parse(&input);
            let _ = FieldSelector::parse(&input);
        }
    }
}
