//! The answers of TokenReviews and SubjectAccessReviews, kept for a while (pure, but for the
//! clock).
//!
//! Every request of a client that is not kube-apiserver's front proxy costs a TokenReview, and
//! every decision a SubjectAccessReview, unless a recent answer is kept. Keys are hashed (a
//! token is never held, a long request path costs nothing more), the cache has a fixed size and
//! evicts its oldest answers one by one (emptying it all at once would send a burst of reviews
//! to kube-apiserver), and reviews in flight are capped, so a flood of unique tokens or paths
//! waits instead of multiplying calls to the cluster.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, SemaphorePermit};

type Key = [u8; 32];

/// Reviews in flight at once, across all callers.
const MAX_REVIEWS_IN_FLIGHT: usize = 16;

pub struct ReviewCache<V> {
    ttl: Duration,
    capacity: usize,
    entries: Mutex<Entries<V>>,
    reviews: Semaphore,
}

struct Entries<V> {
    answers: HashMap<Key, (V, Instant)>,
    /// Keys in the order they were answered; a key answered again appears twice, and only its
    /// last position counts.
    order: VecDeque<(Key, Instant)>,
}

impl<V: Clone> ReviewCache<V> {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        ReviewCache {
            ttl,
            capacity: capacity.max(1),
            entries: Mutex::new(Entries {
                answers: HashMap::new(),
                order: VecDeque::new(),
            }),
            reviews: Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
        }
    }

    pub fn key(parts: &[&[u8]]) -> Key {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part);
        }
        hash.finalize().into()
    }

    /// A fresh answer for `key`.
    pub fn get(&self, key: &Key) -> Option<V> {
        let entries = self.entries.lock().expect("review cache");
        entries
            .answers
            .get(key)
            .filter(|(_, at)| at.elapsed() < self.ttl)
            .map(|(value, _)| value.clone())
    }

    /// Waits for a turn to ask the cluster (at most 16 reviews run at once).
    pub async fn turn(&self) -> SemaphorePermit<'_> {
        self.reviews.acquire().await.expect("never closed")
    }

    pub fn insert(&self, key: Key, value: V) {
        let now = Instant::now();
        let mut entries = self.entries.lock().expect("review cache");
        entries.answers.insert(key, (value, now));
        entries.order.push_back((key, now));
        while entries.answers.len() > self.capacity || entries.order.len() > 2 * self.capacity {
            let Some((oldest, at)) = entries.order.pop_front() else {
                break;
            };
            // Only the key's last answer evicts it.
            if entries
                .answers
                .get(&oldest)
                .is_some_and(|(_, kept)| *kept == at)
            {
                entries.answers.remove(&oldest);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().unwrap().answers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_expire_and_the_oldest_go_first_one_by_one() {
        let cache = ReviewCache::new(Duration::from_secs(60), 3);
        let key = |n: u8| ReviewCache::<u8>::key(&[&[n]]);
        for n in 0..3 {
            cache.insert(key(n), n);
        }
        // Answering 0 again makes 1 the oldest.
        cache.insert(key(0), 10);
        cache.insert(key(3), 3);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&key(1)), None);
        assert_eq!(cache.get(&key(0)), Some(10));
        assert_eq!(cache.get(&key(2)), Some(2));
        assert_eq!(cache.get(&key(3)), Some(3));
        let expired = ReviewCache::new(Duration::ZERO, 3);
        expired.insert(key(0), 0);
        assert_eq!(expired.get(&key(0)), None);
    }

    #[test]
    fn keys_separate_their_parts() {
        assert_ne!(
            ReviewCache::<()>::key(&[b"ab", b"c"]),
            ReviewCache::<()>::key(&[b"a", b"bc"])
        );
    }

    #[test]
    fn a_flood_of_unique_keys_keeps_the_cache_at_its_size() {
        let cache = ReviewCache::new(Duration::from_secs(60), 100);
        for n in 0..10_000u32 {
            cache.insert(ReviewCache::<u32>::key(&[&n.to_be_bytes()]), n);
        }
        assert_eq!(cache.len(), 100);
        assert!(cache.entries.lock().unwrap().order.len() <= 200);
    }
}
