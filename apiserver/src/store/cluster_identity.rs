//! Which cluster a `cluster_id` belongs to, so two clusters never share one by mistake.
//!
//! Several clusters may write to one database, each under its own `--cluster-id`. With the
//! same id (most likely the default, `default`) they would list, watch, overwrite and delete
//! each other's reports, and nothing would say so. A server that knows its cluster (delegated
//! mode: the `kube-system` namespace's UID, which lives as long as the cluster) records it on
//! its id's counter row the first time and refuses to start when the row names another
//! cluster. A cluster rebuilt from scratch (a new UID) that should keep the reports takes the
//! id over once with `--reclaim-cluster-id`.
//!
//! The decision is [`decide`] (pure); [`claim`] is its two statements. Concurrent starts are
//! safe: the record is a conditional `UPDATE … WHERE cluster_uid IS NULL`, so of two clusters
//! starting at once one records its UID and the other reads it back and refuses.

use sea_orm::{ConnectionTrait, DbBackend, Statement};

use super::StoreError;

/// What a starting server does about its cluster id.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The id is this cluster's: go on.
    Ours,
    /// The id names another cluster: refuse, with the UID recorded.
    Taken { recorded: String },
}

/// The verdict on a row whose recorded UID is `recorded` (after this server's attempt to
/// record `ours` where none was).
pub(crate) fn decide(recorded: Option<&str>, ours: &str) -> Claim {
    match recorded {
        None => Claim::Ours,
        Some(r) if r == ours => Claim::Ours,
        Some(r) => Claim::Taken {
            recorded: r.to_owned(),
        },
    }
}

/// Records `ours` on `cluster_id`'s counter row unless another cluster's UID is there (or,
/// with `reclaim`, whatever is there), then checks the row.
pub(crate) async fn claim(
    db: &impl ConnectionTrait,
    backend: DbBackend,
    cluster_id: &str,
    ours: &str,
    reclaim: bool,
) -> Result<(), StoreError> {
    let (record, read) = statements(backend, reclaim);
    db.execute_raw(Statement::from_sql_and_values(
        backend,
        record,
        [ours.into(), cluster_id.into()],
    ))
    .await?;
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            read,
            [cluster_id.into()],
        ))
        .await?
        .ok_or_else(|| {
            StoreError::Inconsistent(format!("no store_state row for cluster id {cluster_id}"))
        })?;
    let recorded: Option<String> = row.try_get("", "cluster_uid")?;
    match decide(recorded.as_deref(), ours) {
        Claim::Ours => {
            if reclaim {
                tracing::warn!(
                    cluster_id,
                    cluster_uid = ours,
                    "--reclaim-cluster-id: the cluster id now belongs to this cluster"
                );
            }
            Ok(())
        }
        Claim::Taken { recorded } => Err(StoreError::ClusterIdTaken {
            cluster_id: cluster_id.to_owned(),
            recorded,
            ours: ours.to_owned(),
        }),
    }
}

fn statements(backend: DbBackend, reclaim: bool) -> (&'static str, &'static str) {
    let postgres = backend == DbBackend::Postgres;
    let record = match (postgres, reclaim) {
        (true, false) => {
            "UPDATE store_state SET cluster_uid = $1 WHERE cluster_id = $2 AND cluster_uid IS NULL"
        }
        (true, true) => "UPDATE store_state SET cluster_uid = $1 WHERE cluster_id = $2",
        (false, false) => {
            "UPDATE store_state SET cluster_uid = ? WHERE cluster_id = ? AND cluster_uid IS NULL"
        }
        (false, true) => "UPDATE store_state SET cluster_uid = ? WHERE cluster_id = ?",
    };
    let read = if postgres {
        "SELECT cluster_uid FROM store_state WHERE cluster_id = $1"
    } else {
        "SELECT cluster_uid FROM store_state WHERE cluster_id = ?"
    };
    (record, read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unrecorded_or_own_id_is_ours() {
        assert_eq!(decide(None, "uid-a"), Claim::Ours);
        assert_eq!(decide(Some("uid-a"), "uid-a"), Claim::Ours);
    }

    #[test]
    fn another_clusters_id_is_taken() {
        assert_eq!(
            decide(Some("uid-b"), "uid-a"),
            Claim::Taken {
                recorded: "uid-b".into()
            }
        );
    }
}
