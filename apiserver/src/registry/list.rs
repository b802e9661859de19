//! Lists: continue tokens bound to their query, and the `resourceVersion` rules of a list.
//!
//! The store serves the live table only, so `resourceVersionMatch=Exact` at anything but the
//! current version is answered as after an etcd compaction (410), and a version from the future
//! gets kube-apiserver's "Too large resource version" (504 with a retry hint).

use crate::continuation::{ContinueToken, TokenError, query_fingerprint};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{ListQuery, ListStream, Store, StoreError, parse_document_public};

use super::{RegistryError, ResourceRef};

pub use crate::store::ListRow;

/// A stored JSON document (a row's body or `metadata`) as a value; `name` names it in errors.
pub fn parse_stored(name: &str, text: &str) -> Result<serde_json::Value, StoreError> {
    parse_document_public(name, text)
}

/// What a list asks for, parsed and validated by the caller.
#[derive(Clone, Debug, Default)]
pub struct ListOptions {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub limit: Option<u64>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
}

/// One page of a list.
#[derive(Debug)]
pub struct ListResult {
    pub rows: Vec<ListRow>,
    /// The list's resourceVersion: the snapshot of its first page.
    pub resource_version: i64,
    /// The token of the next page, when there is one.
    pub continue_token: Option<String>,
}

/// One page of a list, row by row as the store reads it (a response can go out while the page
/// is still being read); the continue token is known once the rows are.
pub struct ListPageStream {
    rows: ListStream,
    /// The list's resourceVersion: the snapshot of its first page.
    resource_version: i64,
    fingerprint: String,
}

impl ListPageStream {
    pub(crate) fn new(rows: ListStream, resource_version: i64, fingerprint: String) -> Self {
        ListPageStream {
            rows,
            resource_version,
            fingerprint,
        }
    }

    pub fn resource_version(&self) -> i64 {
        self.resource_version
    }

    /// A page of `rows` at resourceVersion 7, ending with `failure` if given.
    #[cfg(test)]
    pub(crate) fn scripted(rows: Vec<ListRow>, failure: Option<StoreError>) -> Self {
        ListPageStream::new(ListStream::scripted(rows, failure), 7, "query".into())
    }

    /// The next row; `None` once the page is complete. An error ends the page.
    pub async fn next_row(&mut self) -> Option<Result<ListRow, RegistryError>> {
        Some(self.rows.next_row().await?.map_err(RegistryError::from))
    }

    /// The token of the next page, when there is one; meaningful once
    /// [`ListPageStream::next_row`] returned `None`.
    pub fn continue_token(&self) -> Option<String> {
        self.rows.next_page_after().map(|(namespace, name)| {
            ContinueToken {
                resource_version: self.resource_version,
                namespace: namespace.clone(),
                name: name.clone(),
                query: self.fingerprint.clone(),
            }
            .encode()
        })
    }

    /// The whole page in memory.
    pub async fn collect(mut self) -> Result<ListResult, RegistryError> {
        let mut rows = Vec::new();
        while let Some(row) = self.next_row().await {
            rows.push(row?);
        }
        Ok(ListResult {
            continue_token: self.continue_token(),
            rows,
            resource_version: self.resource_version,
        })
    }
}

/// The store query of a list, its fingerprint (what a continue token is bound to) and the
/// decoded token.
pub fn list_query(
    r: &ResourceRef,
    options: &ListOptions,
    metadata_only: bool,
) -> Result<(ListQuery, String, Option<ContinueToken>), RegistryError> {
    let fingerprint = query_fingerprint(
        &Store::resource_key(r.resource),
        r.namespace.as_deref(),
        &options.labels.to_string(),
        &options.fields.to_string(),
    );
    let token = match &options.continue_token {
        Some(t) => Some(ContinueToken::decode(t, &fingerprint).map_err(|e| match e {
            TokenError::Malformed(_) | TokenError::QueryMismatch => {
                RegistryError::bad_request(e.to_string())
            }
        })?),
        None => None,
    };
    let query = ListQuery {
        resource: r.resource,
        namespace: r.namespace.clone(),
        labels: options.labels.clone(),
        fields: options.fields.clone(),
        limit: options.limit,
        after: token
            .as_ref()
            .map(|t| (t.namespace.clone(), t.name.clone())),
        metadata_only,
    };
    Ok((query, fingerprint, token))
}

/// A `resourceVersion` parameter: a non-negative integer (`0` means "any").
pub fn parse_resource_version(rv: &str) -> Result<i64, RegistryError> {
    match rv.parse::<i64>() {
        Ok(n) if n >= 0 => Ok(n),
        _ => Err(RegistryError::bad_request(format!(
            "resourceVersion: invalid value {rv:?}: must be a non-negative integer"
        ))),
    }
}

/// Where a watch begins (`None`: with the current state as synthetic ADDED events) and whether
/// it ends its initial events with the `initial-events-end` bookmark, from its
/// `resourceVersion` and `sendInitialEvents` and the store's current version.
pub fn watch_start(
    resource_version: Option<&str>,
    send_initial_events: Option<bool>,
    current: i64,
) -> Result<(Option<i64>, bool), RegistryError> {
    let requested = match resource_version {
        None => None,
        Some(rv) => Some(parse_resource_version(rv)?).filter(|&n| n != 0),
    };
    // As kube-apiserver's watch cache does once its wait runs out: a watch from a version the
    // store never reached would stay silent through every change up to it.
    if let Some(requested) = requested.filter(|&n| n > current) {
        return Err(RegistryError::ResourceVersionTooLarge { requested, current });
    }
    Ok(match send_initial_events {
        // Streaming list: the state at least as new as `requested`, then the end bookmark.
        Some(true) => (None, true),
        Some(false) => (Some(requested.unwrap_or(current)), false),
        None => (requested, false),
    })
}

/// A continue token from a newer state than the store's (forged, or from before a restore or
/// a failover to a replica that lags): the client must not read a page as of a version the
/// store never reached, or an informer would silently miss the changes in between.
pub fn check_continue_version(
    token: Option<&ContinueToken>,
    current: i64,
) -> Result<(), RegistryError> {
    match token {
        Some(t) if t.resource_version < 0 => Err(RegistryError::bad_request(
            "continue: the token carries an invalid resourceVersion",
        )),
        Some(t) if t.resource_version > current => Err(RegistryError::ResourceVersionTooLarge {
            requested: t.resource_version,
            current,
        }),
        _ => Ok(()),
    }
}

/// Checks a list's `resourceVersion`/`resourceVersionMatch` against what the store can serve.
pub fn check_list_version(
    options: &ListOptions,
    current: i64,
    compacted: i64,
) -> Result<(), RegistryError> {
    let Some(rv) = options.resource_version.as_deref() else {
        if options.resource_version_match.is_some() {
            return Err(RegistryError::bad_request(
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        return Ok(());
    };
    let n = parse_resource_version(rv)?;
    if n > current {
        return Err(RegistryError::ResourceVersionTooLarge {
            requested: n,
            current,
        });
    }
    if options.resource_version_match.as_deref() == Some("Exact") && n != current {
        return Err(RegistryError::gone(format!(
            "The resourceVersion for the provided list is too old: {n} (current {current}, compacted {compacted})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn where_a_watch_starts() {
        assert_eq!(watch_start(None, None, 7).unwrap(), (None, false));
        assert_eq!(watch_start(Some("0"), None, 7).unwrap(), (None, false));
        assert_eq!(watch_start(Some("5"), None, 7).unwrap(), (Some(5), false));
        assert_eq!(watch_start(Some("5"), Some(true), 7).unwrap(), (None, true));
        assert_eq!(watch_start(None, Some(false), 7).unwrap(), (Some(7), false));
        assert!(matches!(
            watch_start(Some("8"), None, 7),
            Err(RegistryError::ResourceVersionTooLarge {
                requested: 8,
                current: 7
            })
        ));
        assert!(matches!(
            watch_start(Some("-1"), None, 7),
            Err(RegistryError::BadRequest(_))
        ));
    }

    fn at(rv: &str, m: Option<&str>) -> ListOptions {
        ListOptions {
            resource_version: Some(rv.to_owned()),
            resource_version_match: m.map(str::to_owned),
            ..Default::default()
        }
    }

    #[test]
    fn list_versions() {
        assert!(check_list_version(&ListOptions::default(), 5, 1).is_ok());
        assert!(check_list_version(&at("3", None), 5, 1).is_ok());
        assert_eq!(
            check_list_version(&at("9", None), 5, 1)
                .unwrap_err()
                .reason(),
            "Timeout"
        );
        assert_eq!(
            check_list_version(&at("3", Some("Exact")), 5, 1)
                .unwrap_err()
                .reason(),
            "Expired"
        );
        assert_eq!(
            check_list_version(&at("x", None), 5, 1)
                .unwrap_err()
                .reason(),
            "BadRequest"
        );
        let bare_match = ListOptions {
            resource_version_match: Some("Exact".into()),
            ..Default::default()
        };
        assert_eq!(
            check_list_version(&bare_match, 5, 1).unwrap_err().reason(),
            "BadRequest"
        );
    }
}
