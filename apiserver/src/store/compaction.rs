//! The change log's horizon: compaction (entries older than the retention window or beyond the
//! count bound), and the version floor a migration raises. Both run alone on the writer
//! connection under the counter's row lock, outside the group commit rounds.

use sea_orm::sea_query::{DeleteStatement, Expr, ExprTrait, Query, UpdateStatement};
use sea_orm::{ConnectionTrait, TransactionTrait};

use super::schema::{Changes, StoreState};
use super::write::{lock_counter, now_unix};
use super::{Store, StoreError};

/// Drops change-log entries older than the retention window and beyond the count bound,
/// and advances `compacted_rv` so watches from before it get 410 Expired.
pub(super) async fn compact(store: &Store) -> Result<i64, StoreError> {
    let (current, compacted) = store.versions().await?;
    let opts = store.options();
    let by_count = current - opts.watch_history_max_events;
    let cutoff_time = now_unix() - opts.watch_history.as_secs() as i64;
    let by_age: Option<i64> = store
        .connection()
        .query_one(
            &Query::select()
                .expr_as(
                    Expr::col(Changes::Rv).max(),
                    sea_orm::sea_query::Alias::new("m"),
                )
                .from(Changes::Table)
                .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
                .and_where(Expr::col(Changes::CreatedAt).lt(cutoff_time))
                .to_owned(),
        )
        .await?
        .and_then(|r| r.try_get::<Option<i64>>("", "m").ok().flatten());
    // Both bounds apply: an entry goes when it is too old or when too many newer ones exist.
    let horizon = std::cmp::max(by_age.unwrap_or(0), by_count);
    if horizon <= compacted {
        return Ok(compacted);
    }
    let statements = [
        drop_changes_through(store, horizon),
        Query::update()
            .table(StoreState::Table)
            .value(StoreState::CompactedRv, horizon)
            .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(StoreState::CompactedRv).lt(horizon))
            .to_owned()
            .into(),
    ];
    store.write_alone(|_| statements.to_vec()).await?;
    Ok(horizon)
}

/// `DELETE` of this cluster's change-log entries up to and including `rv`.
fn drop_changes_through(store: &Store, rv: i64) -> Statement {
    Query::delete()
        .from_table(Changes::Table)
        .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
        .and_where(Expr::col(Changes::Rv).lte(rv))
        .to_owned()
        .into()
}

/// A statement of a transaction [`Store::write_alone`] runs.
#[derive(Clone)]
pub(super) enum Statement {
    Delete(DeleteStatement),
    Update(UpdateStatement),
}

impl From<DeleteStatement> for Statement {
    fn from(s: DeleteStatement) -> Self {
        Statement::Delete(s)
    }
}

impl From<UpdateStatement> for Statement {
    fn from(s: UpdateStatement) -> Self {
        Statement::Update(s)
    }
}

impl Store {
    /// Runs the statements `plan` makes of the counter's `(current, compacted)` pair in one
    /// transaction on the writer connection (closed if the transaction fails, see
    /// [`super::Writer`]); returns the pair as read.
    pub(super) async fn write_alone(
        &self,
        plan: impl FnOnce((i64, i64)) -> Vec<Statement>,
    ) -> Result<(i64, i64), StoreError> {
        let mut writer = self.write_lock.lock().await;
        let db = writer.connection(self.options()).await?;
        // Abandoned when an outage begins, like a group commit round: see `Store::round`.
        let result = self
            .unless_outage(async {
                let txn = db.begin().await?;
                // The counter's row lock orders this against writers in other processes too.
                let versions = lock_counter(&txn, self.backend(), self.cluster_id()).await?;
                for statement in plan(versions) {
                    match statement {
                        Statement::Delete(s) => txn.execute(&s).await?,
                        Statement::Update(s) => txn.execute(&s).await?,
                    };
                }
                txn.commit().await?;
                Ok(versions)
            })
            .await;
        if let Err(e) = &result {
            writer.discard(e);
        }
        result
    }
}

/// Moves the resourceVersion counter and the watch horizon up to at least `floor`, in one
/// transaction under the write lock; returns the new `(current, compacted)` pair.
///
/// Taking over a group from etcd-backed storage needs it: clients still hold etcd revisions
/// (from lists, watches and bookmarks), and a revision that also names one of our versions
/// would resume a watch at the wrong place. With every version of ours above `floor` and
/// everything up to it compacted, such a revision gets 410 Gone and the client relists.
pub(super) async fn raise_version_floor(
    store: &Store,
    floor: i64,
) -> Result<(i64, i64), StoreError> {
    let raised = |(current, compacted): (i64, i64)| {
        (
            std::cmp::max(current, floor),
            std::cmp::max(compacted, floor),
        )
    };
    let versions = store
        .write_alone(|versions| {
            let (current, compacted) = raised(versions);
            vec![
                drop_changes_through(store, compacted),
                Query::update()
                    .table(StoreState::Table)
                    .value(StoreState::Rv, current)
                    .value(StoreState::CompactedRv, compacted)
                    .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
                    .to_owned()
                    .into(),
            ]
        })
        .await?;
    Ok(raised(versions))
}
