//! Field sets: which fields of an object a manager owns, as a trie of path elements, and their
//! `FieldsV1` wire encoding (`metadata.managedFields[].fieldsV1`).
//!
//! The element kinds and their order follow structured-merge-diff, the library kube-apiserver
//! uses, so that the stored JSON is byte-for-byte what a client would see from a real cluster:
//! `f:<name>` for struct fields and map keys, `k:{...}` for items of lists keyed by fields,
//! `v:<json>` for items of set lists, `i:<n>` for positions (never produced, but accepted), and
//! `.` marking a node that is itself a member as well as a parent of members.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::{Map, Value};

/// A JSON value with the total order structured-merge-diff gives list keys and set items:
/// numbers (compared numerically), strings, booleans, lists, maps, null.
#[derive(Clone, Debug)]
pub struct OrdValue(pub Value);

fn rank(v: &Value) -> u8 {
    match v {
        Value::Number(_) => 0,
        Value::String(_) => 1,
        Value::Bool(_) => 2,
        Value::Array(_) => 3,
        Value::Object(_) => 4,
        Value::Null => 5,
    }
}

/// Compares numbers by value whatever their representation (`1` equals `1.0`).
fn compare_numbers(a: &serde_json::Number, b: &serde_json::Number) -> Ordering {
    match (a.as_i64(), b.as_i64()) {
        (Some(x), Some(y)) => x.cmp(&y),
        _ => match (a.as_u64(), b.as_u64()) {
            (Some(x), Some(y)) => x.cmp(&y),
            _ => {
                let (x, y) = (
                    a.as_f64().unwrap_or(f64::NAN),
                    b.as_f64().unwrap_or(f64::NAN),
                );
                x.partial_cmp(&y).unwrap_or(Ordering::Equal)
            }
        },
    }
}

/// The total order on JSON values used for path elements.
pub fn compare_values(a: &Value, b: &Value) -> Ordering {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => compare_numbers(x, y),
        (Value::String(x), Value::String(y)) => x.cmp(y),
        (Value::Bool(x), Value::Bool(y)) => x.cmp(y),
        (Value::Array(x), Value::Array(y)) => {
            for (p, q) in x.iter().zip(y) {
                let c = compare_values(p, q);
                if c != Ordering::Equal {
                    return c;
                }
            }
            x.len().cmp(&y.len())
        }
        (Value::Object(x), Value::Object(y)) => {
            let mut xs: Vec<_> = x.iter().collect();
            let mut ys: Vec<_> = y.iter().collect();
            xs.sort_by(|p, q| p.0.cmp(q.0));
            ys.sort_by(|p, q| p.0.cmp(q.0));
            for ((kx, vx), (ky, vy)) in xs.iter().zip(&ys) {
                let c = kx.cmp(ky).then_with(|| compare_values(vx, vy));
                if c != Ordering::Equal {
                    return c;
                }
            }
            xs.len().cmp(&ys.len())
        }
        (Value::Null, Value::Null) => Ordering::Equal,
        _ => rank(a).cmp(&rank(b)),
    }
}

/// Deep equality with numbers compared by value, as structured-merge-diff compares leaves.
pub fn values_equal(a: &Value, b: &Value) -> bool {
    a == b || compare_values(a, b) == Ordering::Equal
}

impl PartialEq for OrdValue {
    fn eq(&self, other: &Self) -> bool {
        values_equal(&self.0, &other.0)
    }
}
impl Eq for OrdValue {}
impl PartialOrd for OrdValue {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdValue {
    fn cmp(&self, other: &Self) -> Ordering {
        compare_values(&self.0, &other.0)
    }
}

/// One step of a path into an object. The variant order is the sort order of the wire format.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathElement {
    /// A struct field or a map key.
    Field(String),
    /// An item of a list keyed by some of its fields, the keys sorted by name.
    Key(Vec<(String, OrdValue)>),
    /// An item of a set list, by value.
    Value(OrdValue),
    /// An item by position.
    Index(usize),
}

/// Go's `%q` rendering of a string, which conflict messages use for key values.
fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// structured-merge-diff's human rendering of a value inside a path (`[uid="…"]`).
fn display_value(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::String(s) => go_quote(s),
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(display_value)
                .collect::<Vec<_>>()
                .join(",")
        ),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| format!("{k}={}", display_value(v)))
            .collect(),
        other => other.to_string(),
    }
}

impl fmt::Display for PathElement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathElement::Field(name) => write!(f, ".{name}"),
            PathElement::Key(keys) => {
                let parts: Vec<String> = keys
                    .iter()
                    .map(|(k, v)| format!("{k}={}", display_value(&v.0)))
                    .collect();
                write!(f, "[{}]", parts.join(","))
            }
            PathElement::Value(v) => write!(f, "[={}]", display_value(&v.0)),
            PathElement::Index(i) => write!(f, "[{i}]"),
        }
    }
}

/// Renders a path the way kube-apiserver prints it in conflict messages: `.summary.pass`,
/// `.metadata.ownerReferences[uid="…"]`, `.metadata.finalizers[="…"]`.
pub fn display_path(path: &[PathElement]) -> String {
    path.iter().map(ToString::to_string).collect()
}

/// JSON as Go's encoder writes it inside keys: HTML-sensitive characters escaped.
fn go_json(v: &Value) -> String {
    let text = v.to_string();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

impl PathElement {
    /// The `FieldsV1` key of this element.
    pub fn encode(&self) -> String {
        match self {
            PathElement::Field(name) => format!("f:{name}"),
            PathElement::Key(keys) => {
                let mut m = Map::new();
                for (k, v) in keys {
                    m.insert(k.clone(), v.0.clone());
                }
                format!("k:{}", go_json(&Value::Object(m)))
            }
            PathElement::Value(v) => format!("v:{}", go_json(&v.0)),
            PathElement::Index(i) => format!("i:{i}"),
        }
    }

    /// Parses a `FieldsV1` key; `Ok(None)` for element kinds this version does not know, which
    /// are skipped as structured-merge-diff skips them.
    pub fn decode(key: &str) -> Result<Option<Self>, String> {
        let Some((kind, rest)) = key.split_once(':') else {
            return Err(format!("missing colon in field path element {key:?}"));
        };
        if kind.len() != 1 {
            return Err(format!("invalid field path element {key:?}"));
        }
        Ok(Some(match kind {
            "f" => PathElement::Field(rest.to_owned()),
            "k" => {
                let v: Value = serde_json::from_str(rest)
                    .map_err(|e| format!("invalid key in field path element {key:?}: {e}"))?;
                let Value::Object(m) = v else {
                    return Err(format!("key of {key:?} is not a JSON object"));
                };
                let mut keys: Vec<(String, OrdValue)> =
                    m.into_iter().map(|(k, v)| (k, OrdValue(v))).collect();
                keys.sort_by(|a, b| a.0.cmp(&b.0));
                PathElement::Key(keys)
            }
            "v" => {
                PathElement::Value(OrdValue(serde_json::from_str(rest).map_err(|e| {
                    format!("invalid value in field path element {key:?}: {e}")
                })?))
            }
            "i" => PathElement::Index(
                rest.parse()
                    .map_err(|_| format!("invalid index in field path element {key:?}"))?,
            ),
            _ => return Ok(None),
        }))
    }
}

/// A set of paths, stored as a trie: `members` are paths that end here, `children` continue.
/// Children are never empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSet {
    members: BTreeSet<PathElement>,
    children: BTreeMap<PathElement, FieldSet>,
}

impl FieldSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty() && self.children.is_empty()
    }

    /// Adds a path; the empty path (the object itself) is never a member.
    pub fn insert(&mut self, path: &[PathElement]) {
        match path {
            [] => {}
            [last] => {
                self.members.insert(last.clone());
            }
            [first, rest @ ..] => self.children.entry(first.clone()).or_default().insert(rest),
        }
    }

    pub fn contains(&self, path: &[PathElement]) -> bool {
        match path {
            [] => false,
            [last] => self.members.contains(last),
            [first, rest @ ..] => self.children.get(first).is_some_and(|c| c.contains(rest)),
        }
    }

    pub fn is_member(&self, pe: &PathElement) -> bool {
        self.members.contains(pe)
    }

    /// The paths below `pe`, relative to it.
    pub fn child(&self, pe: &PathElement) -> Option<&FieldSet> {
        self.children.get(pe)
    }

    pub(crate) fn members(&self) -> impl Iterator<Item = &PathElement> {
        self.members.iter()
    }

    pub(crate) fn children(&self) -> impl Iterator<Item = (&PathElement, &FieldSet)> {
        self.children.iter()
    }

    pub(crate) fn add_member(&mut self, pe: PathElement) {
        self.members.insert(pe);
    }

    pub(crate) fn set_child(&mut self, pe: PathElement, child: FieldSet) {
        if child.is_empty() {
            self.children.remove(&pe);
        } else {
            self.children.insert(pe, child);
        }
    }

    pub fn union(&self, other: &FieldSet) -> FieldSet {
        let mut out = self.clone();
        out.members.extend(other.members.iter().cloned());
        for (pe, child) in &other.children {
            let merged = match out.children.get(pe) {
                Some(mine) => mine.union(child),
                None => child.clone(),
            };
            out.children.insert(pe.clone(), merged);
        }
        out
    }

    pub fn intersection(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet::new();
        out.members = self.members.intersection(&other.members).cloned().collect();
        for (pe, child) in &self.children {
            if let Some(theirs) = other.children.get(pe) {
                out.set_child(pe.clone(), child.intersection(theirs));
            }
        }
        out
    }

    /// The paths of `self` that are not paths of `other` (a member of `other` does not remove
    /// what lies below it).
    pub fn difference(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet::new();
        out.members = self.members.difference(&other.members).cloned().collect();
        for (pe, child) in &self.children {
            let rest = match other.children.get(pe) {
                Some(theirs) => child.difference(theirs),
                None => child.clone(),
            };
            out.set_child(pe.clone(), rest);
        }
        out
    }

    /// Every path, members of a node before the paths below its children, in element order.
    pub fn paths(&self) -> Vec<Vec<PathElement>> {
        let mut out = Vec::new();
        self.collect(&mut Vec::new(), &mut out);
        out
    }

    fn collect(&self, prefix: &mut Vec<PathElement>, out: &mut Vec<Vec<PathElement>>) {
        for m in &self.members {
            let mut p = prefix.clone();
            p.push(m.clone());
            out.push(p);
        }
        for (pe, child) in &self.children {
            prefix.push(pe.clone());
            child.collect(prefix, out);
            prefix.pop();
        }
    }

    /// The `FieldsV1` JSON object.
    pub fn to_fields_v1(&self) -> Value {
        Value::Object(self.emit(false))
    }

    fn emit(&self, include_self: bool) -> Map<String, Value> {
        let mut out = Map::new();
        if include_self && !self.is_empty() {
            out.insert(".".into(), Value::Object(Map::new()));
        }
        let mut keys: BTreeSet<&PathElement> = self.members.iter().collect();
        keys.extend(self.children.keys());
        for pe in keys {
            let member = self.members.contains(pe);
            let value = match self.children.get(pe) {
                Some(child) => Value::Object(child.emit(member)),
                None => Value::Object(Map::new()),
            };
            out.insert(pe.encode(), value);
        }
        out
    }

    /// Parses a `FieldsV1` JSON object.
    pub fn from_fields_v1(v: &Value) -> Result<FieldSet, String> {
        Ok(Self::read(v)?.0)
    }

    fn read(v: &Value) -> Result<(FieldSet, bool), String> {
        let Value::Object(m) = v else {
            return Err(format!("expected a JSON object in fieldsV1, got {v}"));
        };
        let mut set = FieldSet::new();
        let mut is_member = false;
        for (key, value) in m {
            if key == "." {
                is_member = true;
                continue;
            }
            let Some(pe) = PathElement::decode(key)? else {
                continue;
            };
            let (child, member) = Self::read(value)?;
            if child.is_empty() {
                // `{}` on its own is a leaf; `{".": {}}` is the same thing spelled out.
                set.members.insert(pe);
            } else {
                if member {
                    set.members.insert(pe.clone());
                }
                set.children.insert(pe, child);
            }
        }
        Ok((set, is_member))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn f(name: &str) -> PathElement {
        PathElement::Field(name.into())
    }

    #[test]
    fn fields_v1_round_trips_with_dot_entries_and_order() {
        let wire = json!({
            "f:metadata": {
                "f:finalizers": {".": {}, "v:\"a/b\"": {}},
                "f:labels": {".": {}, "f:app": {}},
                "f:ownerReferences": {".": {}, "k:{\"uid\":\"u1\"}": {}}
            },
            "f:summary": {".": {}, "f:fail": {}, "f:pass": {}}
        });
        let set = FieldSet::from_fields_v1(&wire).unwrap();
        assert!(set.contains(&[f("metadata"), f("labels"), f("app")]));
        assert!(set.contains(&[f("metadata"), f("labels")]));
        assert!(!set.contains(&[f("metadata")]));
        assert_eq!(set.to_fields_v1(), wire);
        assert_eq!(set.to_fields_v1().to_string(), wire.to_string());
    }

    #[test]
    fn element_order_and_rendering_follow_structured_merge_diff() {
        let key = PathElement::Key(vec![("uid".into(), OrdValue(json!("x")))]);
        let value = PathElement::Value(OrdValue(json!("fin")));
        assert!(f("z") < key && key < value && value < PathElement::Index(0));
        assert_eq!(
            display_path(&[f("metadata"), f("ownerReferences"), key.clone()]),
            ".metadata.ownerReferences[uid=\"x\"]"
        );
        assert_eq!(
            display_path(&[f("finalizers"), value]),
            ".finalizers[=\"fin\"]"
        );
        assert_eq!(key.encode(), "k:{\"uid\":\"x\"}");
        assert_eq!(
            PathElement::Value(OrdValue(json!("<&>"))).encode(),
            "v:\"\\u003c\\u0026\\u003e\""
        );
        assert_eq!(PathElement::decode("x:1").unwrap(), None);
        assert!(PathElement::decode("nocolon").is_err());
        assert!(values_equal(&json!(1), &json!(1.0)));
    }

    #[test]
    fn set_algebra() {
        let mut a = FieldSet::new();
        a.insert(&[f("s"), f("x")]);
        a.insert(&[f("s"), f("y")]);
        a.insert(&[f("t")]);
        let mut b = FieldSet::new();
        b.insert(&[f("s"), f("y")]);
        b.insert(&[f("u")]);
        let d = a.difference(&b);
        assert_eq!(d.paths(), vec![vec![f("t")], vec![f("s"), f("x")]]);
        let i = a.intersection(&b);
        assert_eq!(i.paths(), vec![vec![f("s"), f("y")]]);
        assert_eq!(a.union(&b).paths().len(), 4);
        assert!(a.difference(&a).is_empty());
    }
}
