//! When the statistics worker takes a compliance snapshot and what it prunes: pure functions of
//! the clock, so every case is a unit test.
//!
//! Snapshots fall in fixed slots of the interval counted from the Unix epoch (UTC midnight for
//! the daily default): one per slot, the first as soon as a server leads. Slots rather than
//! "interval since the last one" keep the points of a trend at the same time of day after
//! restarts and lease handovers, and line the clusters of a fleet up.

use std::time::Duration;

fn seconds(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// The start of the slot of `interval` that holds `at` (Unix seconds).
pub fn slot_of(at: i64, interval: Duration) -> i64 {
    let interval = seconds(interval).max(1);
    at.div_euclid(interval) * interval
}

/// Whether a snapshot is due at `now`, the newest one being recorded at `last` (its slot's
/// start). A zero interval takes none.
pub fn snapshot_due(last: Option<i64>, now: i64, interval: Duration) -> bool {
    if interval.is_zero() {
        return false;
    }
    match last {
        None => true,
        Some(last) => slot_of(last, interval) < slot_of(now, interval),
    }
}

/// How long until the next slot begins after `now` (at least a second).
pub fn until_next_slot(now: i64, interval: Duration) -> Duration {
    let next = slot_of(now, interval).saturating_add(seconds(interval).max(1));
    Duration::from_secs(u64::try_from(next - now).unwrap_or(1).max(1))
}

/// Snapshots taken before this are deleted; `None` with a zero retention (keep everything).
pub fn prune_before(now: i64, retention: Duration) -> Option<i64> {
    (!retention.is_zero()).then(|| now.saturating_sub(seconds(retention)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);
    /// 2026-11-28T00:00:00Z.
    const MIDNIGHT: i64 = 1_795_824_000;

    #[test]
    fn the_first_snapshot_is_due_at_once_and_then_one_per_slot() {
        assert!(snapshot_due(None, MIDNIGHT + 3_600, DAY));
        // Taken at 01:00: nothing more that day, even 23 h later.
        assert!(!snapshot_due(
            Some(MIDNIGHT + 3_600),
            MIDNIGHT + 86_399,
            DAY
        ));
        // The next day's slot has begun.
        assert!(snapshot_due(Some(MIDNIGHT + 3_600), MIDNIGHT + 86_400, DAY));
        // A server that was down for a week takes one, not seven.
        assert!(snapshot_due(Some(MIDNIGHT), MIDNIGHT + 7 * 86_400 + 5, DAY));
    }

    #[test]
    fn a_zero_interval_takes_no_snapshot() {
        assert!(!snapshot_due(None, MIDNIGHT, Duration::ZERO));
    }

    #[test]
    fn slots_count_from_the_epoch_so_hourly_snapshots_fall_on_the_hour() {
        let hour = Duration::from_secs(3_600);
        assert_eq!(slot_of(MIDNIGHT + 5_399, hour), MIDNIGHT + 3_600);
        assert_eq!(
            until_next_slot(MIDNIGHT + 5_399, hour),
            Duration::from_secs(1_801)
        );
        assert_eq!(until_next_slot(MIDNIGHT, DAY), DAY);
    }

    #[test]
    fn retention_keeps_everything_when_zero() {
        assert_eq!(prune_before(MIDNIGHT, Duration::ZERO), None);
        assert_eq!(prune_before(MIDNIGHT, DAY), Some(MIDNIGHT - 86_400));
    }
}
