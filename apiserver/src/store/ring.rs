//! The change feed's buffer of recent changes, bounded by bytes rather than by a count.
//!
//! Every live watcher reads the same entries through its own [`Cursor`]; nothing is copied per
//! watcher. An entry is held only until every live cursor has read it, so a server whose
//! watchers keep up (or that has none) holds next to nothing, however much was written: the
//! buffer is slack for slow watchers, not a cache (a new watcher reads history from the change
//! log). The bound is on the bytes the entries hold (their encoded JSON), so a burst of large
//! reports cannot grow the process the way a count-bounded buffer of parsed objects did (about
//! 550 MB at 16,384 entries of 9 KB reports). A cursor that falls behind the oldest entry
//! learns how many it missed and its watcher is cut off, to resume from the change log: a slow
//! watcher never holds more than the bound or slows the writers.
//!
//! Pure and synchronous apart from waiting for the next entry; unit-tested here.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A cursor fell behind: this many entries were dropped before it read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lagged(pub u64);

/// Called with what the ring holds after every change to it (for metrics).
type Observer = Box<dyn Fn(Occupancy) + Send + Sync>;

/// A buffer of the entries some live cursor has yet to read, holding at most `max_bytes` (and
/// always the newest one, however large, while a cursor may read it).
pub struct Ring<T> {
    state: Mutex<State<T>>,
    appended: Notify,
    max_bytes: usize,
    observer: Option<Observer>,
}

struct State<T> {
    entries: VecDeque<(Arc<T>, usize)>,
    /// Sequence number of `entries[0]`.
    first: u64,
    bytes: usize,
    /// Position (next sequence number to read) → live cursors there. The smallest key is the
    /// oldest entry anyone still needs.
    cursors: BTreeMap<u64, usize>,
}

impl<T> State<T> {
    fn end(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    fn occupancy(&self) -> Occupancy {
        Occupancy {
            entries: self.entries.len(),
            bytes: self.bytes,
        }
    }

    fn pop_front(&mut self) {
        let (_, dropped) = self.entries.pop_front().expect("an entry to drop");
        self.bytes -= dropped;
        self.first += 1;
    }

    /// Drops the entries every live cursor has read; whether there were any.
    fn drop_read(&mut self) -> bool {
        let needed_from = self.cursors.keys().next().copied().unwrap_or(u64::MAX);
        let before = self.first;
        while self.first < needed_from && !self.entries.is_empty() {
            self.pop_front();
        }
        self.first != before
    }

    fn add_cursor(&mut self, at: u64) {
        *self.cursors.entry(at).or_default() += 1;
    }

    fn remove_cursor(&mut self, at: u64) {
        if let Some(n) = self.cursors.get_mut(&at) {
            *n -= 1;
            if *n == 0 {
                self.cursors.remove(&at);
            }
        }
    }

    /// Moves a cursor; whether entries were dropped because of it.
    fn move_cursor(&mut self, from: u64, to: u64) -> bool {
        self.remove_cursor(from);
        self.add_cursor(to);
        self.drop_read()
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
        Self::build(max_bytes, None)
    }

    /// A ring that tells `observer` what it holds after every change: a push, and a read or a
    /// dropped cursor that frees entries (reads that free nothing, the common case on the
    /// watchers' hot path, do not call it).
    pub fn observed(
        max_bytes: usize,
        observer: impl Fn(Occupancy) + Send + Sync + 'static,
    ) -> Arc<Self> {
        Self::build(max_bytes, Some(Box::new(observer)))
    }

    fn build(max_bytes: usize, observer: Option<Observer>) -> Arc<Self> {
        Arc::new(Ring {
            state: Mutex::new(State {
                entries: VecDeque::new(),
                first: 0,
                bytes: 0,
                cursors: BTreeMap::new(),
            }),
            appended: Notify::new(),
            max_bytes,
            observer,
        })
    }

    fn observe(&self, state: &State<T>) {
        if let Some(observer) = &self.observer {
            observer(state.occupancy());
        }
    }

    /// Appends an entry of `bytes` bytes, drops the oldest ones beyond the bound (and, with no
    /// live cursor, everything: nobody could read it), and wakes the cursors. Returns what the
    /// ring holds afterwards.
    pub fn push(&self, entry: Arc<T>, bytes: usize) -> Occupancy {
        let held = {
            let mut state = self.state.lock().expect("ring lock");
            state.entries.push_back((entry, bytes));
            state.bytes += bytes;
            while state.bytes > self.max_bytes && state.entries.len() > 1 {
                state.pop_front();
            }
            state.drop_read();
            self.observe(&state);
            state.occupancy()
        };
        self.appended.notify_waiters();
        held
    }

    /// A cursor that reads every entry pushed after this call.
    pub fn subscribe(self: &Arc<Self>) -> Cursor<T> {
        let mut state = self.state.lock().expect("ring lock");
        let next = state.end();
        state.add_cursor(next);
        Cursor {
            ring: self.clone(),
            next,
        }
    }

    pub fn occupancy(&self) -> Occupancy {
        self.state.lock().expect("ring lock").occupancy()
    }
}

/// One reader's position in a [`Ring`]; the entries from its position on are held for it
/// (within the ring's bound) until it reads them or is dropped.
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
        let ring = &self.ring;
        let mut state = ring.state.lock().expect("ring lock");
        let at = self.next;
        if at < state.first {
            let missed = state.first - at;
            self.next = state.first;
            if state.move_cursor(at, self.next) {
                ring.observe(&state);
            }
            return Some(Err(Lagged(missed)));
        }
        let entry = state.entries.get((at - state.first) as usize)?.0.clone();
        self.next += 1;
        if state.move_cursor(at, self.next) {
            ring.observe(&state);
        }
        Some(Ok(entry))
    }
}

impl<T> Drop for Cursor<T> {
    fn drop(&mut self) {
        // A poisoned lock means a panic elsewhere already; nothing to release then.
        if let Ok(mut state) = self.ring.state.lock() {
            state.remove_cursor(self.next);
            if state.drop_read() {
                self.ring.observe(&state);
            }
        }
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
        let _reader = ring.subscribe();
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

    #[test]
    fn entries_every_cursor_has_read_are_dropped() {
        let ring = Ring::new(1_000);
        let mut fast = ring.subscribe();
        let mut slow = ring.subscribe();
        for i in 0..3 {
            ring.push(Arc::new(i), 10);
        }
        for _ in 0..3 {
            assert!(matches!(fast.try_recv(), Some(Ok(_))));
        }
        // The slow cursor still needs all three.
        assert_eq!(ring.occupancy().entries, 3);
        assert_eq!(slow.try_recv(), Some(Ok(Arc::new(0))));
        assert_eq!(
            ring.occupancy(),
            Occupancy {
                entries: 2,
                bytes: 20
            }
        );
        // Dropping the slow cursor releases what only it needed.
        drop(slow);
        assert_eq!(ring.occupancy().entries, 0);
        ring.push(Arc::new(3), 10);
        assert_eq!(fast.try_recv(), Some(Ok(Arc::new(3))));
        assert_eq!(ring.occupancy().entries, 0);
    }

    #[test]
    fn with_no_cursor_nothing_is_held() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let ring = {
            let seen = seen.clone();
            Ring::observed(1_000, move |o| seen.lock().unwrap().push(o.entries))
        };
        for i in 0..5 {
            assert_eq!(ring.push(Arc::new(i), 100).entries, 0);
        }
        let cursor = ring.subscribe();
        ring.push(Arc::new(5), 100);
        assert_eq!(ring.occupancy().entries, 1);
        drop(cursor);
        assert_eq!(*seen.lock().unwrap(), vec![0, 0, 0, 0, 0, 1, 0]);
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
