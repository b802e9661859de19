//! `--where KEY OP VALUE` over a result's `properties`: a small syntax parsed into a typed
//! [`Condition`], so the key and value reach SQL only as bound parameters (and the key, limited
//! to `[A-Za-z0-9_.-]`, as a quoted column alias).

use crate::AnalyticsError;

/// How a property is compared with the condition's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Comparison {
    /// `=`: the property's text equals the value.
    Equals(String),
    /// `!=`: the property is present and its text differs from the value.
    Differs(String),
    /// `>`, `>=`, `<`, `<=`: the property read as a number (properties are strings, e.g. a
    /// CVSS `score: "8.1"`); a property that is not a number never matches.
    Numeric(Order, f64),
}

/// The ordering operators, in the order [`Order::sql`] spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Greater,
    GreaterOrEqual,
    Less,
    LessOrEqual,
}

impl Order {
    pub fn sql(self) -> &'static str {
        match self {
            Order::Greater => ">",
            Order::GreaterOrEqual => ">=",
            Order::Less => "<",
            Order::LessOrEqual => "<=",
        }
    }
}

/// One parsed `--where`.
#[derive(Clone, Debug, PartialEq)]
pub struct Condition {
    pub key: String,
    pub comparison: Comparison,
}

/// The operators, longest first so that `>=` is not read as `>` followed by `=…`.
const OPERATORS: [&str; 6] = [">=", "<=", "!=", "=", ">", "<"];

impl std::str::FromStr for Condition {
    type Err = AnalyticsError;

    fn from_str(expression: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| AnalyticsError::InvalidCondition {
            expression: expression.to_owned(),
            reason: reason.to_owned(),
        };
        let at = expression
            .find(['=', '!', '<', '>'])
            .ok_or_else(|| invalid("no operator"))?;
        let (key, rest) = (expression[..at].trim(), &expression[at..]);
        let operator = OPERATORS
            .into_iter()
            .find(|op| rest.starts_with(op))
            .ok_or_else(|| invalid("`!` must be followed by `=`"))?;
        let value = rest[operator.len()..].trim();
        if key.is_empty() {
            return Err(invalid("the property name is empty"));
        }
        if !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        {
            return Err(invalid(
                "a property name holds only letters, digits, `_`, `.` and `-`",
            ));
        }
        let number = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite())
                .ok_or_else(|| invalid("`>`, `>=`, `<` and `<=` compare with a number"))
        };
        let comparison = match operator {
            "=" => Comparison::Equals(value.to_owned()),
            "!=" => Comparison::Differs(value.to_owned()),
            ">" => Comparison::Numeric(Order::Greater, number()?),
            ">=" => Comparison::Numeric(Order::GreaterOrEqual, number()?),
            "<" => Comparison::Numeric(Order::Less, number()?),
            _ => Comparison::Numeric(Order::LessOrEqual, number()?),
        };
        Ok(Condition {
            key: key.to_owned(),
            comparison,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(expression: &str) -> Result<Condition, String> {
        expression.parse::<Condition>().map_err(|e| e.to_string())
    }

    #[test]
    fn every_operator_is_read_with_its_value() {
        let numeric = |key: &str, order, n| Condition {
            key: key.into(),
            comparison: Comparison::Numeric(order, n),
        };
        assert_eq!(
            parse("score>=8.0").unwrap(),
            numeric("score", Order::GreaterOrEqual, 8.0)
        );
        assert_eq!(
            parse(" score > 7 ").unwrap(),
            numeric("score", Order::Greater, 7.0)
        );
        assert_eq!(
            parse("score<=-1.5").unwrap(),
            numeric("score", Order::LessOrEqual, -1.5)
        );
        assert_eq!(
            parse("score<3").unwrap(),
            numeric("score", Order::Less, 3.0)
        );
        assert_eq!(
            parse("vulnerabilityID=CVE-2024-1234").unwrap().comparison,
            Comparison::Equals("CVE-2024-1234".into())
        );
        assert_eq!(
            parse("artifact.repository!=library/nginx").unwrap(),
            Condition {
                key: "artifact.repository".into(),
                comparison: Comparison::Differs("library/nginx".into()),
            }
        );
        // The value may hold operators itself: only the first one splits.
        assert_eq!(
            parse("title=a=b").unwrap().comparison,
            Comparison::Equals("a=b".into())
        );
    }

    #[test]
    fn what_could_reach_sql_as_text_is_refused() {
        for (expression, reason) in [
            ("score", "no operator"),
            ("=8", "empty"),
            ("score!8", "followed by `=`"),
            ("sc\"ore>=8", "only letters"),
            ("score') OR 1=1 --=1", "only letters"),
            ("score>=high", "with a number"),
            ("score>=NaN", "with a number"),
        ] {
            let error = parse(expression).unwrap_err();
            assert!(error.contains(reason), "{expression}: {error}");
        }
    }
}
