//! Unknown- and duplicate-field detection for `fieldValidation` (pure).
//!
//! Unknown fields are found by comparing what the client sent with the canonical object the
//! schema kept (pruning is how CRD storage handles them too). Duplicate keys are found with a
//! serde visitor that parses the raw JSON (a `Value` parsed the usual way has kept only the last
//! of the repeated keys).
//!
//! Both run on every write of a ~10 KB report, and almost always find nothing: a field's path
//! is a chain of borrowed frames on the stack, turned into text only for a finding.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// Where a value sits in a document: `spec.foo`, `results[0].bar`.
#[derive(Clone, Copy)]
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

/// Findings noted per request: a body of repeated or unknown keys is reported by its first
/// ones, so the bookkeeping of a hostile body stays small whatever it repeats.
pub const MAX_NOTED_FIELDS: usize = 100;
/// A noted path longer than this is cut (with `…`): keys may be long and nested deep.
pub const MAX_PATH_BYTES: usize = 256;

impl Path<'_> {
    fn render(&self) -> String {
        let mut frames = Vec::new();
        let mut at = self;
        loop {
            match at {
                Path::Root => break,
                Path::Key(parent, _) | Path::Index(parent, _) => {
                    frames.push(at);
                    at = parent;
                }
            }
        }
        let mut out = String::new();
        for frame in frames.into_iter().rev() {
            match frame {
                Path::Key(_, key) => {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(key);
                }
                Path::Index(_, i) => {
                    out.push('[');
                    out.push_str(&i.to_string());
                    out.push(']');
                }
                Path::Root => {}
            }
            if out.len() > MAX_PATH_BYTES {
                let mut end = MAX_PATH_BYTES;
                while !out.is_char_boundary(end) {
                    end -= 1;
                }
                out.truncate(end);
                out.push('…');
                break;
            }
        }
        out
    }
}

/// Notes `path` unless enough findings are noted already.
fn note(out: &mut Vec<String>, path: Path<'_>) {
    if out.len() < MAX_NOTED_FIELDS {
        out.push(path.render());
    }
}

/// Paths of fields present in `sent` but absent from `kept`, e.g. `spec.foo` or `results[0].bar`.
pub fn unknown_fields(sent: &Value, kept: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(sent, kept, Path::Root, &mut out);
    out
}

fn walk(sent: &Value, kept: &Value, path: Path<'_>, out: &mut Vec<String>) {
    match (sent, kept) {
        (Value::Object(s), Value::Object(k)) => {
            for (key, value) in s {
                match k.get(key) {
                    Some(kv) => walk(value, kv, Path::Key(&path, key), out),
                    // A null the schema dropped is "unset", not unknown.
                    None if value.is_null() => {}
                    None => note(out, Path::Key(&path, key)),
                }
            }
        }
        (Value::Array(s), Value::Array(k)) => {
            for (i, (sv, kv)) in s.iter().zip(k).enumerate() {
                walk(sv, kv, Path::Index(&path, i), out);
            }
        }
        _ => {}
    }
}

/// Parses JSON as `serde_json::from_slice` does (a repeated key keeps its first position and
/// its last value) and returns the paths of the repeated keys with it: one pass over a
/// request body instead of a parse and a second scan.
pub fn parse_noting_duplicates(raw: &[u8]) -> Result<(Value, Vec<String>), serde_json::Error> {
    let mut notes = Notes::for_body(raw);
    let mut de = serde_json::Deserializer::from_slice(raw);
    let value = Collect {
        path: Path::Root,
        notes: &mut notes,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((value, notes.duplicates))
}

/// Parses one YAML document into JSON values. YAML aliases repeat what they point to, so a
/// small body can describe a huge document ("billion laughs"); what is built is bounded like
/// a JSON body's, and a document that expands past that is refused while it is being built.
pub fn parse_yaml(raw: &[u8]) -> Result<Value, serde_yaml::Error> {
    let mut notes = Notes::for_body(raw);
    Collect {
        path: Path::Root,
        notes: &mut notes,
    }
    .deserialize(serde_yaml::Deserializer::from_slice(raw))
}

/// What parsing one body noted, and how much more it may build.
struct Notes {
    duplicates: Vec<String>,
    /// Bytes (as compact JSON would count them) the document may still grow by.
    remaining: usize,
}

impl Notes {
    /// A JSON document is never larger than its text; four times that leaves room for YAML's
    /// own anchors and merges, 1 MiB for small bodies.
    fn for_body(raw: &[u8]) -> Self {
        Notes {
            duplicates: Vec::new(),
            remaining: raw.len().saturating_mul(4).max(1 << 20),
        }
    }

    fn spend<E: de::Error>(&mut self, bytes: usize) -> Result<(), E> {
        self.remaining = self.remaining.checked_sub(bytes).ok_or_else(|| {
            E::custom("the document expands far beyond the size of the request body (aliases?)")
        })?;
        Ok(())
    }
}

/// Builds the `Value` at `path`, noting repeated keys.
struct Collect<'p, 'o> {
    path: Path<'p>,
    notes: &'o mut Notes,
}

impl<'de> DeserializeSeed<'de> for Collect<'_, '_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Collect<'_, '_> {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.notes.spend(5)?;
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.notes.spend(8)?;
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.notes.spend(8)?;
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.notes.spend(8)?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.notes.spend(v.len() + 2)?;
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.notes.spend(v.len() + 2)?;
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.notes.spend(4)?;
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.notes.spend(2)?;
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element_seed(Collect {
            path: Path::Index(&self.path, items.len()),
            notes: &mut *self.notes,
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        self.notes.spend(2)?;
        let mut map = serde_json::Map::new();
        while let Some(key) = access.next_key::<String>()? {
            self.notes.spend(key.len() + 3)?;
            let value = access.next_value_seed(Collect {
                path: Path::Key(&self.path, &key),
                notes: &mut *self.notes,
            })?;
            match map.entry(key) {
                serde_json::map::Entry::Occupied(mut seen) => {
                    note(
                        &mut self.notes.duplicates,
                        Path::Key(&self.path, seen.key()),
                    );
                    seen.insert(value);
                }
                serde_json::map::Entry::Vacant(new) => {
                    new.insert(value);
                }
            }
        }
        Ok(Value::Object(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn duplicate_fields(raw: &[u8]) -> Vec<String> {
        parse_noting_duplicates(raw).unwrap().1
    }

    #[test]
    fn finds_unknown_fields_but_not_nulls() {
        let sent = json!({"a": 1, "typo": 2, "n": null, "list": [{"x": 1, "y": 2}], "m": {"k": 1, "extra": true}});
        let kept = json!({"a": 1, "list": [{"x": 1}], "m": {"k": 1}});
        assert_eq!(
            unknown_fields(&sent, &kept),
            ["typo", "list[0].y", "m.extra"]
        );
    }

    #[test]
    fn finds_duplicates_at_any_depth() {
        let raw = br#"{"a": 1, "a": 2, "b": {"c": 1, "c": 1}, "l": [{"d": 0, "d": 1}]}"#;
        assert_eq!(duplicate_fields(raw), ["a", "b.c", "l[0].d"]);
        assert!(duplicate_fields(br#"{"a": {"a": 1}}"#).is_empty());
    }

    #[test]
    fn yaml_aliases_cannot_expand_a_small_body_into_a_huge_document() {
        let mut yaml = format!("a: &a \"{}\"\n", "x".repeat(50_000));
        yaml += "b: [";
        yaml += &vec!["*a"; 2_000].join(", ");
        yaml += "]\n";
        let err = parse_yaml(yaml.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("expands"), "{err}");
        // A few aliases, as hand-written YAML uses them, are fine.
        let value = parse_yaml(b"a: &a {k: v}\nb: *a\nc: [1, 2.5, null, true]\n").unwrap();
        assert_eq!(
            value,
            json!({"a": {"k": "v"}, "b": {"k": "v"}, "c": [1, 2.5, null, true]})
        );
    }

    #[test]
    fn findings_are_capped_in_number_and_length() {
        let key = "k".repeat(1000);
        let mut raw = String::from("{");
        for i in 0..5_000 {
            raw += &format!("\"{key}\": {{\"x\": {i}, \"x\": {i}}},");
        }
        raw += "\"end\": 0}";
        let found = duplicate_fields(raw.as_bytes());
        assert_eq!(found.len(), MAX_NOTED_FIELDS);
        assert!(
            found
                .iter()
                .all(|p| p.len() <= MAX_PATH_BYTES + '…'.len_utf8() && p.ends_with('…'))
        );
        let sent = Value::Object((0..5_000).map(|i| (format!("u{i}"), json!(i))).collect());
        assert_eq!(unknown_fields(&sent, &json!({})).len(), MAX_NOTED_FIELDS);
    }

    #[test]
    fn duplicates_compare_unescaped_keys_and_render_nested_paths() {
        // `\u0062` is `b`: the two keys are the same field.
        let raw =
            br#"{"s": {"r": [[], [{"ab": 1, "a\u0062": 2}]]}, "x": [1, {"y": {"z": 0, "z": 0}}]}"#;
        assert_eq!(duplicate_fields(raw), ["s.r[1][0].ab", "x[1].y.z"]);
    }

    #[test]
    fn parsing_noting_duplicates_gives_what_serde_json_gives() {
        let raw = br#"{"b": [1, -2, 3.5, 1e300, "\u00e9", null, true, {}], "a": {"x": 1, "y": 2, "x": 3}}"#;
        let (value, duplicates) = parse_noting_duplicates(raw).unwrap();
        assert_eq!(value, serde_json::from_slice::<Value>(raw).unwrap());
        assert_eq!(
            serde_json::to_string(&value).unwrap(),
            serde_json::to_string(&serde_json::from_slice::<Value>(raw).unwrap()).unwrap()
        );
        assert_eq!(duplicates, ["a.x"]);
        for bad in [&b"{"[..], b"[1,]", b"{} {}", b"nul"] {
            assert!(parse_noting_duplicates(bad).is_err());
        }
    }

    #[test]
    fn unknown_fields_render_nested_paths() {
        let sent = json!({"s": {"r": [{}, {"k": 1, "extra": [1]}]}});
        let kept = json!({"s": {"r": [{}, {"k": 1}]}});
        assert_eq!(unknown_fields(&sent, &kept), ["s.r[1].extra"]);
    }
}
