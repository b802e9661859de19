//! Unknown- and duplicate-field detection for `fieldValidation` (pure).
//!
//! Unknown fields are found by comparing what the client sent with the canonical object the
//! schema kept (pruning is how CRD storage handles them too). Duplicate keys are found with a
//! serde visitor over the raw JSON, since a parsed `Value` has already kept only the last one.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// Paths of fields present in `sent` but absent from `kept`, e.g. `spec.foo` or `results[0].bar`.
pub fn unknown_fields(sent: &Value, kept: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(sent, kept, String::new(), &mut out);
    out
}

fn walk(sent: &Value, kept: &Value, path: String, out: &mut Vec<String>) {
    match (sent, kept) {
        (Value::Object(s), Value::Object(k)) => {
            for (key, value) in s {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match k.get(key) {
                    Some(kv) => walk(value, kv, child, out),
                    // A null the schema dropped is "unset", not unknown.
                    None if value.is_null() => {}
                    None => out.push(child),
                }
            }
        }
        (Value::Array(s), Value::Array(k)) => {
            for (i, (sv, kv)) in s.iter().zip(k).enumerate() {
                walk(sv, kv, format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Paths of keys that appear twice in the same JSON object.
pub fn duplicate_fields(raw: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(raw);
    let _ = Walker {
        path: String::new(),
        out: &mut out,
    }
    .deserialize(&mut de);
    out
}

struct Walker<'a> {
    path: String,
    out: &'a mut Vec<String>,
}

impl<'de> DeserializeSeed<'de> for Walker<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walker<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        while seq
            .next_element_seed(Walker {
                path: format!("{}[{i}]", self.path),
                out: self.out,
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let child = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            if !seen.insert(key) {
                self.out.push(child.clone());
            }
            map.next_value_seed(Walker {
                path: child,
                out: self.out,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
