//! A plain HTTP/1.0 GET on loopback, for the local processes the tests run that answer plain
//! HTTP (Patroni's REST API, etcd's health, Policy Reporter, Kyverno's metrics), and the
//! Prometheus text format their metrics come in. HTTP/1.0 makes the server close the connection
//! after the body, so there is no chunked encoding to undo and no HTTP client to pull in.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET http://127.0.0.1:<port><path>` within `deadline`: the status code and the body.
pub async fn get(port: u16, path: &str, deadline: Duration) -> Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let text = tokio::time::timeout(deadline, exchange)
        .await
        .with_context(|| format!("GET 127.0.0.1:{port}{path}: no answer within {deadline:?}"))??;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("GET 127.0.0.1:{port}{path}: malformed answer"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((code, body.to_owned()))
}

/// One sample of the Prometheus text exposition format.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, `""` when absent.
    pub fn label(&self, key: &str) -> String {
        self.labels.get(key).cloned().unwrap_or_default()
    }
}

/// Parses the samples of a Prometheus text exposition (comments skipped; label values unescaped:
/// `\\`, `\"`, `\n`).
pub fn parse_prometheus(text: &str) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = line[..name_end].to_owned();
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(after) = rest.strip_prefix('{') {
            let (parsed, tail) = parse_labels(after).with_context(|| format!("in {line:?}"))?;
            labels = parsed;
            rest = tail;
        }
        let value = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| anyhow!("no value in {line:?}"))?;
        let value = value
            .parse::<f64>()
            .with_context(|| format!("value of {line:?}"))?;
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(samples)
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the `}`.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    let mut rest = s.trim_start_matches(',');
    loop {
        rest = rest.trim_start();
        if let Some(tail) = rest.strip_prefix('}') {
            return Ok((labels, tail));
        }
        let eq = rest.find('=').ok_or_else(|| anyhow!("label without ="))?;
        let key = rest[..eq].trim().to_owned();
        let mut chars = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or_else(|| anyhow!("label {key} without a quoted value"))?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => bail!("label {key}: escape at the end"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => bail!("label {key}: unterminated value"),
            }
        };
        labels.insert(key, value);
        // `end` indexes the closing quote within the value part.
        let consumed = eq + 1 + 1 + end + 1;
        rest = rest[consumed..].trim_start().trim_start_matches(',');
    }
}
