//! The change feed's buffer of recent changes, bounded by bytes rather than by a count.
//!
//! Every live watcher reads the same entries through its own [`Cursor`]; nothing is copied per
//! watcher. The bound is on the bytes the entries hold (their encoded JSON), so a burst of large
//! reports cannot grow the process the way a count-bounded buffer of parsed objects did (about
//! 550 MB at 16,384 entries of 9 KB reports). A cursor that falls behind the oldest entry
//! learns how many it missed and its watcher is cut off, to resume from the change log: a slow
//! watcher never holds memory or slows the writers.
//!
//! Pure and synchronous apart from waiting for the next entry; unit-tested here.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A cursor fell behind: this many entries were dropped before it read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lagged(pub u64);

/// A buffer of the most recent entries holding at most `max_bytes` (and always the newest one,
/// however large).
pub struct Ring<T> {
    state: Mutex<State<T>>,
    appended: Notify,
    max_bytes: usize,
}

struct State<T> {
    entries: VecDeque<(Arc<T>, usize)>,
    /// Sequence number of `entries[0]`.
    first: u64,
    bytes: usize,
}

impl<T> State<T> {
    fn end(&self) -> u64 {
        self.first + self.entries.len() as u64
    }
}

/// What a ring holds, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    pub entries: usize,
    pub bytes: usize,
}

impl<T> Ring<T> {
    pub fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(Ring {
            state: Mutex::new(State {
                entries: VecDeque::new(),
                first: 0,
                bytes: 0,
            }),
            appended: Notify::new(),
            max_bytes,
        })
    }

    /// Appends an entry of `bytes` bytes, drops the oldest ones beyond the bound, and wakes the
    /// cursors. Returns what the ring holds afterwards.
    pub fn push(&self, entry: Arc<T>, bytes: usize) -> Occupancy {
        let held = {
            let mut state = self.state.lock().expect("ring lock");
            state.entries.push_back((entry, bytes));
            state.bytes += bytes;
            while state.bytes > self.max_bytes && state.entries.len() > 1 {
                let (_, dropped) = state.entries.pop_front().expect("more than one entry");
                state.bytes -= dropped;
                state.first += 1;
            }
            Occupancy {
                entries: state.entries.len(),
                bytes: state.bytes,
            }
        };
        self.appended.notify_waiters();
        held
    }

    /// A cursor that reads every entry pushed after this call.
    pub fn subscribe(self: &Arc<Self>) -> Cursor<T> {
        let next = self.state.lock().expect("ring lock").end();
        Cursor {
            ring: self.clone(),
            next,
        }
    }

    pub fn occupancy(&self) -> Occupancy {
        let state = self.state.lock().expect("ring lock");
        Occupancy {
            entries: state.entries.len(),
            bytes: state.bytes,
        }
    }
}

/// One reader's position in a [`Ring`].
pub struct Cursor<T> {
    ring: Arc<Ring<T>>,
    next: u64,
}

impl<T> Cursor<T> {
    /// The next entry, waiting for it if need be. `Err(Lagged(n))` when `n` entries were dropped
    /// before this cursor read them; the cursor then continues at the oldest entry still held.
    /// Cancel-safe: dropping the future loses nothing.
    pub async fn recv(&mut self) -> Result<Arc<T>, Lagged> {
        let ring = self.ring.clone();
        loop {
            let appended = ring.appended.notified();
            tokio::pin!(appended);
            // Registered before looking, so a push between the look and the wait still wakes us.
            appended.as_mut().enable();
            if let Some(next) = self.try_recv() {
                return next;
            }
            appended.await;
        }
    }

    /// The next entry if one is there.
    pub fn try_recv(&mut self) -> Option<Result<Arc<T>, Lagged>> {
        let state = self.ring.state.lock().expect("ring lock");
        if self.next < state.first {
            let missed = state.first - self.next;
            self.next = state.first;
            return Some(Err(Lagged(missed)));
        }
        let entry = state.entries.get((self.next - state.first) as usize)?;
        self.next += 1;
        Some(Ok(entry.0.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_cursor_reads_only_what_was_pushed_after_it_subscribed_in_order() {
        let ring = Ring::new(1_000);
        ring.push(Arc::new(1), 10);
        let mut cursor = ring.subscribe();
        assert!(cursor.try_recv().is_none());
        ring.push(Arc::new(2), 10);
        ring.push(Arc::new(3), 10);
        assert_eq!(cursor.try_recv(), Some(Ok(Arc::new(2))));
        assert_eq!(cursor.try_recv(), Some(Ok(Arc::new(3))));
        assert!(cursor.try_recv().is_none());
    }

    #[test]
    fn the_bound_is_on_bytes_and_the_newest_entry_always_stays() {
        let ring = Ring::new(100);
        for i in 0..10 {
            ring.push(Arc::new(i), 30);
        }
        assert_eq!(
            ring.occupancy(),
            Occupancy {
                entries: 3,
                bytes: 90
            }
        );
        assert_eq!(
            ring.push(Arc::new(10), 500),
            Occupancy {
                entries: 1,
                bytes: 500
            }
        );
    }

    #[test]
    fn a_cursor_that_falls_behind_learns_how_many_it_missed_then_continues() {
        let ring = Ring::new(100);
        let mut slow = ring.subscribe();
        for i in 0..10 {
            ring.push(Arc::new(i), 30);
        }
        // 10 pushed, the last 3 held.
        assert_eq!(slow.try_recv(), Some(Err(Lagged(7))));
        assert_eq!(slow.try_recv(), Some(Ok(Arc::new(7))));
    }

    #[test]
    fn many_cursors_share_one_entry() {
        let ring = Ring::new(1_000);
        let mut a = ring.subscribe();
        let mut b = ring.subscribe();
        ring.push(Arc::new(String::from("x")), 1);
        let (Some(Ok(x)), Some(Ok(y))) = (a.try_recv(), b.try_recv()) else {
            panic!("both cursors read the entry");
        };
        assert!(Arc::ptr_eq(&x, &y));
    }

    #[tokio::test]
    async fn recv_waits_for_a_push_and_is_cancel_safe() {
        let ring = Ring::new(1_000);
        let mut cursor = ring.subscribe();
        // Cancelled while waiting: nothing is lost.
        assert!(
            tokio::time::timeout(Duration::from_millis(20), cursor.recv())
                .await
                .is_err()
        );
        let pusher = {
            let ring = ring.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                ring.push(Arc::new(42), 1);
            })
        };
        assert_eq!(cursor.recv().await, Ok(Arc::new(42)));
        pusher.await.unwrap();
    }
}
