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

impl Path<'_> {
    fn render(&self) -> String {
        let mut out = String::new();
        self.render_into(&mut out);
        out
    }

    fn render_into(&self, out: &mut String) {
        match self {
            Path::Root => {}
            Path::Key(parent, key) => {
                parent.render_into(out);
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Path::Index(parent, i) => {
                parent.render_into(out);
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
        }
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
                    None => out.push(Path::Key(&path, key).render()),
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
    let mut duplicates = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(raw);
    let value = Collect {
        path: Path::Root,
        duplicates: &mut duplicates,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((value, duplicates))
}

/// Builds the `Value` at `path`, noting repeated keys.
struct Collect<'p, 'o> {
    path: Path<'p>,
    duplicates: &'o mut Vec<String>,
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
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(Collect {
            path: Path::Index(&self.path, items.len()),
            duplicates: &mut *self.duplicates,
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = serde_json::Map::new();
        while let Some(key) = access.next_key::<String>()? {
            let value = access.next_value_seed(Collect {
                path: Path::Key(&self.path, &key),
                duplicates: &mut *self.duplicates,
            })?;
            match map.entry(key) {
                serde_json::map::Entry::Occupied(mut seen) => {
                    self.duplicates
                        .push(Path::Key(&self.path, seen.key()).render());
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
