//! A question's answer as rows of JSON values, and its four renderings: an aligned `table` for
//! people, `json` and `yaml` (a list of objects, columns in order) for programs, `csv`
//! (RFC 4180) for spreadsheets.

use serde_json::{Map, Value};

use crate::AnalyticsError;

/// The rows a query returned, in its column order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Value>>,
}

/// `--output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
    Csv,
    Yaml,
}

impl Table {
    /// Each row as an object keyed by column name, columns in query order.
    pub fn objects(&self) -> Vec<Map<String, Value>> {
        self.rows
            .iter()
            .map(|row| {
                self.columns
                    .iter()
                    .cloned()
                    .zip(row.iter().cloned())
                    .collect()
            })
            .collect()
    }

    pub fn render(&self, output: Output) -> Result<String, AnalyticsError> {
        let failed = |e: &dyn std::fmt::Display| AnalyticsError::Render(e.to_string());
        match output {
            Output::Table => Ok(self.aligned()),
            Output::Json => serde_json::to_string_pretty(&self.objects())
                .map(|s| s + "\n")
                .map_err(|e| failed(&e)),
            Output::Yaml => serde_yaml::to_string(&self.objects()).map_err(|e| failed(&e)),
            Output::Csv => Ok(self.csv()),
        }
    }

    /// kubectl's look: upper-case headers, columns padded to their widest cell, `<none>` for
    /// NULL, ratios to three decimals; columns of numbers (NULL aside) aligned right.
    fn aligned(&self) -> String {
        let header: Vec<String> = self.columns.iter().map(|c| c.to_uppercase()).collect();
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| row.iter().map(|v| cell(v, true)).collect())
            .collect();
        let widths: Vec<usize> = (0..header.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|row| row[i].chars().count())
                    .chain([header[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let numeric: Vec<bool> = (0..header.len())
            .map(|i| {
                let mut present = self.rows.iter().map(|r| &r[i]).filter(|v| !v.is_null());
                present.clone().next().is_some() && present.all(Value::is_number)
            })
            .collect();
        let line = |row: &[String]| {
            let padded: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, text)| match numeric[i] {
                    true => format!("{text:>width$}", width = widths[i]),
                    false => format!("{text:<width$}", width = widths[i]),
                })
                .collect();
            padded.join("   ").trim_end().to_owned() + "\n"
        };
        let mut out = line(&header);
        for row in &cells {
            out.push_str(&line(row));
        }
        out
    }

    fn csv(&self) -> String {
        let line = |fields: Vec<String>| {
            let quoted: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
            quoted.join(",") + "\r\n"
        };
        let mut out = line(self.columns.clone());
        for row in &self.rows {
            out.push_str(&line(row.iter().map(|v| cell(v, false)).collect()));
        }
        out
    }
}

/// A value as text; in a table NULL is `<none>` and a fraction has three decimals.
fn cell(value: &Value, for_table: bool) -> String {
    match value {
        Value::Null if for_table => "<none>".into(),
        Value::Null => String::new(),
        Value::String(text) if for_table => text.replace(['\n', '\r'], " "),
        Value::String(text) => text.clone(),
        Value::Number(n) if for_table && n.is_f64() => format!("{:.3}", n.as_f64().unwrap_or(0.0)),
        other => other.to_string(),
    }
}

/// RFC 4180: a field with a comma, quote or line break is quoted, quotes doubled.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Table {
        Table {
            columns: vec![
                "namespace".into(),
                "fail".into(),
                "ratio".into(),
                "message".into(),
            ],
            rows: vec![
                vec![
                    json!("team-a"),
                    json!(12),
                    json!(0.5),
                    json!("one, \"two\""),
                ],
                vec![json!(""), json!(3), Value::Null, Value::Null],
            ],
        }
    }

    #[test]
    fn table_aligns_text_left_and_numbers_right() {
        assert_eq!(
            sample().render(Output::Table).unwrap(),
            "NAMESPACE   FAIL    RATIO   MESSAGE\n\
             team-a        12    0.500   one, \"two\"\n\
             \x20              3   <none>   <none>\n"
        );
    }

    #[test]
    fn csv_quotes_what_needs_it_and_leaves_null_empty() {
        assert_eq!(
            sample().render(Output::Csv).unwrap(),
            "namespace,fail,ratio,message\r\nteam-a,12,0.5,\"one, \"\"two\"\"\"\r\n,3,,\r\n"
        );
    }

    #[test]
    fn json_and_yaml_keep_column_order_and_types() {
        let json: Value = serde_json::from_str(&sample().render(Output::Json).unwrap()).unwrap();
        assert_eq!(
            json[0],
            json!({"namespace": "team-a", "fail": 12, "ratio": 0.5, "message": "one, \"two\""})
        );
        let keys: Vec<&String> = json[0].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["namespace", "fail", "ratio", "message"]);
        let yaml = sample().render(Output::Yaml).unwrap();
        assert!(
            yaml.starts_with("- namespace: team-a\n  fail: 12\n  ratio: 0.5\n"),
            "{yaml}"
        );
        let back: Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(back, json);
    }
}
