//! The stored `results` rows an update's diff starts from (`result_diff`), and who reads them.
//!
//! Read by the group commit round, under the counter's lock, they put a `SELECT` on the serial
//! path of every update. So a writer whose new results share none with those of the version it
//! read needs none (`result_diff::none_can_stay`: the round deletes them by report, unread);
//! otherwise the writer reads them itself, after its read of the object and outside the round,
//! and the round takes that read when the report is still at the version read. That is sound
//! because a report's rows change only in the commit that changes its version, and the writer
//! read them after it read the version: rows newer than that version imply a newer version,
//! which the round sees. Two things this rests on: both reads go to the primary (the store's
//! own pool; there are no replica reads), and nothing writes `results` rows without a new
//! version of their report (a data migration that rewrites them must bump the versions or run
//! with no server up). The round reads the rest (writers that decided again inside a round,
//! retries) itself, a few hundred reports per statement.
//!
//! The writer's read is an optimization: when it fails for any reason but an outage, the
//! writer goes on without it and the round reads the rows.

use std::collections::HashSet;

use reports_server_crds::ResourceDescriptor;
use sea_orm::DatabaseTransaction;

use super::decision::{Current, Decided, StoredResults, Target};
use super::result_diff::StoredRows;
use super::{Store, StoreError};

/// A target of a round with the current row it replaces.
pub(super) struct Replaced<'a> {
    pub resource: &'static ResourceDescriptor,
    pub decided: &'a Decided,
    pub current: &'a mut Current,
    /// The writer's read of the rows (taken: a retry reads them again).
    pub read: &'a mut Option<StoredResults>,
}

impl Store {
    /// The result rows of the reports `decided` replaces, read after the rows (`(id, rv)` per
    /// target) it decided on: the round takes them instead of reading them under its lock when
    /// the report is still at that version (see the module doc).
    pub(super) async fn read_replaced_results(
        &self,
        targets: &[Target<'_>],
        rows: &[Option<(i64, i64)>],
        decided: &[Decided],
    ) -> Result<Vec<Option<StoredResults>>, StoreError> {
        let replaced: Vec<Option<(i64, i64)>> = targets
            .iter()
            .zip(rows)
            .zip(decided)
            .map(|((target, row), decided)| {
                row.filter(|_| decided.puts_result_rows(target.resource) && !decided.none_stay)
            })
            .collect();
        let ids: Vec<i64> = replaced.iter().flatten().map(|(id, _)| *id).collect();
        let unread = || {
            std::iter::repeat_with(|| None)
                .take(replaced.len())
                .collect()
        };
        if ids.is_empty() {
            return Ok(unread());
        }
        let read = self.result_rows_of(self.connection(), &ids);
        let mut by_report = match self.unless_outage(read).await {
            Ok(by_report) => by_report,
            Err(e) if e.is_unavailable() => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "reading the rows an update replaces failed; the round reads them");
                return Ok(unread());
            }
        };
        Ok(replaced
            .into_iter()
            .map(|row| {
                row.map(|(id, rv)| StoredResults {
                    id,
                    rv,
                    rows: by_report.remove(&id).unwrap_or_default(),
                })
            })
            .collect())
    }

    /// Puts what is known of the stored rows of each report that `replaced` puts into its
    /// [`Current`]: none stay, the writer's read, or this round's read.
    pub(super) async fn fill_stored_rows(
        &self,
        txn: &DatabaseTransaction,
        mut replaced: Vec<Replaced<'_>>,
    ) -> Result<(), StoreError> {
        replaced.retain(|r| r.decided.puts_result_rows(r.resource));
        let mut unread = HashSet::new();
        for r in &mut replaced {
            match r.read.take() {
                _ if r.decided.none_stay => r.current.stored_results = StoredRows::NoneStay,
                Some(read) if read.id == r.current.id && read.rv == r.current.rv => {
                    r.current.stored_results = StoredRows::Read(read.rows);
                }
                _ => {
                    unread.insert(r.current.id);
                }
            }
        }
        if unread.is_empty() {
            return Ok(());
        }
        let listed: Vec<i64> = unread.iter().copied().collect();
        let mut stored = self.result_rows_of(txn, &listed).await?;
        for r in replaced
            .iter_mut()
            .filter(|r| unread.contains(&r.current.id))
        {
            // A report without rows has none to keep, whatever an earlier read left here.
            r.current.stored_results =
                StoredRows::Read(stored.remove(&r.current.id).unwrap_or_default());
        }
        Ok(())
    }
}
