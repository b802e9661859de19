//! The write API, the writer's side: read, decide outside the round, hand the decision over.
//!
//! A writer's decision grows with its request: a 3 MiB report is parsed, validated, given its
//! managed fields and cut into 12,000 result rows. Made while a group commit round waits for it
//! (holding the transaction and the counter's row lock), it held every other writer: an
//! unrelated create waited 0.3–0.6 s behind one such write. So a writer reads its targets first,
//! outside any transaction, decides on what it read, and queues the decision with the versions
//! it decided on. A round writes a decision whose targets are still at those versions without
//! waiting for anyone. When a target changed in between, the round offers the writer what is
//! current: a decision that was cheap is made again inside the round (hot objects keep their
//! throughput); an expensive one steps out of the round and decides again outside, and only
//! after [`OUTSIDE_ATTEMPTS`] such rounds inside (so a writer racing a stream of others still
//! finishes). A create does not read: it presumes there is no object (the round reads every
//! target anyway), and if the round finds one it decides again outside, as an expensive
//! decision would.

use std::time::{Duration, Instant};

use reports_server_crds::ResourceDescriptor;
use serde_json::Value;

use super::EventType::{Added, Deleted, Modified};
use super::columns::result_rows;
use super::decision::{Decided, Mutation, Seen, Target, WriteOutcome, current_rv};
use super::group_commit::{Admission, OwnedTarget, Presumed};
use super::prepared::Prepared;
use super::result_diff::none_can_stay;
use super::{Store, StoreError, parse_document};

/// A decision that took longer than this is not made again inside a round.
const INSIDE_DECISION_BUDGET: Duration = Duration::from_millis(2);

/// Decisions made outside before a writer whose targets keep changing decides inside a round.
const OUTSIDE_ATTEMPTS: usize = 3;

impl Store {
    /// Reads the object at `namespace/name`, lets `decide` choose what to do, and does it.
    /// `decide` runs again when the object changed between its read and the write.
    pub async fn mutate<E, F>(
        &self,
        resource: &'static ResourceDescriptor,
        namespace: &str,
        name: &str,
        dry_run: bool,
        mut decide: F,
    ) -> Result<WriteOutcome, E>
    where
        E: From<StoreError>,
        F: FnMut(Option<Value>) -> Result<Mutation, E>,
    {
        let target = Target {
            resource,
            namespace,
            name,
        };
        let mut outcomes = self
            .mutate_batch(&[target], dry_run, |_, current| decide(current))
            .await?;
        Ok(outcomes.pop().expect("one outcome per target"))
    }

    /// [`Store::mutate`] for a write that expects no object at `namespace/name` (a create):
    /// `decide` first runs on `None` without a read, and again on the object if the round finds
    /// one. Reading first cost every create a statement and a round trip outside the round: on
    /// PostgreSQL through kube-apiserver, a third of the database's time per create.
    pub async fn mutate_new<E, F>(
        &self,
        target: Target<'_>,
        dry_run: bool,
        mut decide: F,
    ) -> Result<WriteOutcome, E>
    where
        E: From<StoreError>,
        F: FnMut(Option<Value>) -> Result<Mutation, E>,
    {
        let target = [target];
        let mut outcomes = match dry_run {
            true => self.dry_run(&target, |_, current| decide(current)).await?,
            false => {
                let owned = OwnedTarget::all_of(&target)?;
                let first = FirstSight::PresumedAbsent;
                self.write(&target, owned, first, |_, current| decide(current))
                    .await?
            }
        };
        Ok(outcomes.pop().expect("one outcome per target"))
    }

    /// Stores whole objects as given (server-owned metadata included; namespace and name from
    /// their metadata) in one transaction, replacing any with the same name; returns the last
    /// resourceVersion written. For loading many objects at once: benchmarks and tests seed
    /// with it; API writes go through [`Store::mutate`].
    pub async fn put_all(
        &self,
        resource: &'static ResourceDescriptor,
        objects: Vec<Value>,
    ) -> Result<i64, StoreError> {
        let keys: Vec<(String, String)> = objects
            .iter()
            .map(|o| {
                let text = |field: &str| o["metadata"][field].as_str().unwrap_or("").to_owned();
                (text("namespace"), text("name"))
            })
            .collect();
        let targets: Vec<Target<'_>> = keys
            .iter()
            .map(|(namespace, name)| Target {
                resource,
                namespace,
                name,
            })
            .collect();
        let outcomes = self
            .mutate_batch::<StoreError, _>(&targets, false, |i, _| {
                Ok(Mutation::Put(objects[i].clone()))
            })
            .await?;
        Ok(outcomes.last().map_or(0, |o| o.resource_version))
    }

    /// Applies a decision to each target in one transaction: all of them or none. `decide`
    /// runs once per target, and again for every target when one of them changed between the
    /// read it decided on and the write.
    pub async fn mutate_batch<E, F>(
        &self,
        targets: &[Target<'_>],
        dry_run: bool,
        decide: F,
    ) -> Result<Vec<WriteOutcome>, E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        if dry_run {
            return self.dry_run(targets, decide).await;
        }
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let owned = OwnedTarget::all_of(targets)?;
        let first = FirstSight::Read(self.read_seen(&owned).await?);
        self.write(targets, owned, first, decide).await
    }

    /// Decides on what the writer read or presumes of each target, queues the decisions for a
    /// round and decides again while the round finds the targets changed.
    async fn write<E, F>(
        &self,
        targets: &[Target<'_>],
        owned: Vec<OwnedTarget>,
        first: FirstSight,
        mut decide: F,
    ) -> Result<Vec<WriteOutcome>, E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        let (mut seen, mut presumed_absent) = match first {
            FirstSight::Read(seen) => (seen, false),
            FirstSight::PresumedAbsent => (targets.iter().map(|_| None).collect(), true),
        };
        let mut attempt = 0;
        loop {
            let began = Instant::now();
            let rows: Vec<Option<(i64, i64)>> = seen
                .iter()
                .map(|s| s.as_ref().map(|s| (s.id, s.rv)))
                .collect();
            let decided = self.decide_on(targets, seen, &mut decide)?;
            // A create that finds an object decides again outside the round: its decision (an
            // AlreadyExists, usually) would parse the stored object, megabytes perhaps, while
            // every writer of the round waits.
            let cheap = !presumed_absent && began.elapsed() <= INSIDE_DECISION_BUDGET;
            let stored = self.read_replaced_results(targets, &rows, &decided).await?;
            let presumed = Presumed {
                versions: rows.iter().map(|r| r.map(|(_, rv)| rv)).collect(),
                decided,
                stored,
            };
            let ticket = self.enqueue(owned.clone(), presumed);
            let now = match ticket.offer.await.map_err(|_| leader_gone())?? {
                Admission::Accepted => {
                    return Ok(ticket.done.wait().await?);
                }
                Admission::Changed(now) => now,
            };
            attempt += 1;
            if cheap || attempt >= OUTSIDE_ATTEMPTS {
                // An error here drops the ticket: the round goes on without this writer.
                let decided = self.decide_on(targets, now, &mut decide)?;
                ticket.decision.send(decided).map_err(|_| leader_gone())?;
                return Ok(ticket.done.wait().await?);
            }
            // Dropping the ticket steps out of the round; the next attempt decides on `now`.
            seen = now;
            presumed_absent = false;
        }
    }

    /// What `decide` would do, read and decided without writing.
    async fn dry_run<E, F>(
        &self,
        targets: &[Target<'_>],
        mut decide: F,
    ) -> Result<Vec<WriteOutcome>, E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        let mut outcomes = Vec::with_capacity(targets.len());
        for (i, t) in targets.iter().enumerate() {
            let current = self.get_object(t.resource, t.namespace, t.name).await?;
            let rv = current.as_ref().and_then(current_rv).unwrap_or(0);
            let (object, event) = match decide(i, current.clone())? {
                Mutation::Put(object) if current.is_some() => (Some(object), Some(Modified)),
                Mutation::Put(object) => (Some(object), Some(Added)),
                Mutation::Delete => (current, Some(Deleted)),
                Mutation::Unchanged => (current, None),
            };
            outcomes.push(WriteOutcome {
                object,
                json: None,
                event,
                resource_version: rv,
            });
        }
        Ok(outcomes)
    }
}

impl Store {
    /// The writer's decision on each target from the rows it saw, each put's row prepared (the
    /// result rows cut, the body's columns taken, the rules this process knows looked up) so
    /// the round only has to write it.
    fn decide_on<E, F>(
        &self,
        targets: &[Target<'_>],
        seen: Vec<Option<Seen>>,
        decide: &mut F,
    ) -> Result<Vec<Decided>, E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        let mut decided = Vec::with_capacity(targets.len());
        for (i, (target, seen)) in targets.iter().zip(seen).enumerate() {
            let current = match seen {
                Some(seen) => Some(parse_document(
                    &format!("{}/{}", target.namespace, target.name),
                    &seen.body,
                )?),
                None => None,
            };
            let mut mutation = decide(i, current.clone())?;
            let prepared = match &mut mutation {
                Mutation::Put(object) => Prepared::of(target.resource, object).map(|mut p| {
                    p.rule_ids = self.rule_cache.known_ids(&p.results);
                    p
                }),
                Mutation::Delete | Mutation::Unchanged => None,
            };
            let mut decision = Decided {
                mutation,
                current,
                prepared,
                none_stay: false,
            };
            if let (Some(old), Some(new)) = (&decision.current, &decision.prepared)
                && decision.puts_result_rows(target.resource)
            {
                decision.none_stay =
                    none_can_stay(&result_rows(target.resource, old), &new.results);
            }
            decided.push(decision);
        }
        Ok(decided)
    }
}

/// What a writer first decides on.
enum FirstSight {
    /// The rows it read (`None`: no such object).
    Read(Vec<Option<Seen>>),
    /// No object at any target, presumed without reading (a create).
    PresumedAbsent,
}

fn leader_gone() -> StoreError {
    StoreError::unavailable("the write's group commit ended before it started; retry the request")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use reports_server_crds::catalog::POLICY_REPORT;
    use serde_json::json;

    use super::*;
    use crate::store::StoreOptions;

    async fn store(dir: &tempfile::TempDir) -> Store {
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("db").display());
        Store::connect(StoreOptions::new(url)).await.unwrap()
    }

    fn report(name: &str, count: u64) -> Value {
        json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                "creationTimestamp": "2026-11-26T00:00:00Z",
                "labels": {"count": count.to_string()}}})
    }

    fn count_of(object: &Value) -> u64 {
        object["metadata"]["labels"]["count"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Increments the `count` label of `name`, deciding for at least `decision` each time.
    async fn increment(store: &Store, name: &str, decision: Duration) -> WriteOutcome {
        store
            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", name, false, |current| {
                std::thread::sleep(decision);
                let mut next = current.expect("seeded");
                let count = count_of(&next);
                next["metadata"]["labels"]["count"] = json!((count + 1).to_string());
                Ok(Mutation::Put(next))
            })
            .await
            .unwrap()
    }

    /// A slow decision is made before the writer's round: a write to another object does not
    /// wait for it (it did, for as long as the decision took, when rounds waited for it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_slow_decision_does_not_hold_other_writers() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        store
            .put_all(&POLICY_REPORT, vec![report("slow", 0)])
            .await
            .unwrap();
        let slow = tokio::spawn({
            let store = store.clone();
            async move { increment(&store, "slow", Duration::from_millis(600)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let began = Instant::now();
        store
            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", "other", false, |_| {
                Ok(Mutation::Put(report("other", 0)))
            })
            .await
            .unwrap();
        let other = began.elapsed();
        assert!(!slow.is_finished(), "the slow writer is still deciding");
        assert!(
            other < Duration::from_millis(400),
            "an unrelated write took {other:?} beside a 600 ms decision"
        );
        assert_eq!(count_of(&slow.await.unwrap().object.unwrap()), 1);
    }

    /// A round caught by an outage is abandoned when the circuit opens: its writer hears that
    /// nothing was stored, and a write after the outage does not queue behind it. Here the
    /// round waits on another connection's write lock, as one on a half-open connection waits
    /// on TCP retransmission.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_caught_by_an_outage_is_abandoned() {
        use sqlx::Connection;
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let url = format!("sqlite://{}", dir.path().join("db").display());
        let mut other_process = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other_process)
            .await
            .unwrap();
        let caught = tokio::spawn({
            let store = store.clone();
            async move {
                store
                    .mutate::<StoreError, _>(&POLICY_REPORT, "ns", "caught", false, |_| {
                        Ok(Mutation::Put(report("caught", 0)))
                    })
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!caught.is_finished(), "the round waits for the write lock");
        store.health().failed("no answer within 1s");
        let outcome = tokio::time::timeout(Duration::from_secs(2), caught)
            .await
            .expect("the round is abandoned when the circuit opens")
            .unwrap();
        // Caught before its COMMIT was sent: nothing was stored, and the writer is told so.
        assert!(
            matches!(outcome, Err(StoreError::Unavailable { .. })),
            "{outcome:?}"
        );
        sqlx::query("ROLLBACK")
            .execute(&mut other_process)
            .await
            .unwrap();
        store.health().answered();
        tokio::time::timeout(
            Duration::from_secs(5),
            store.mutate::<StoreError, _>(&POLICY_REPORT, "ns", "after", false, |_| {
                Ok(Mutation::Put(report("after", 0)))
            }),
        )
        .await
        .expect("a write after the outage does not wait for the abandoned round")
        .unwrap();
    }

    /// Writers racing on one object, slow deciders (which step out of the round and decide
    /// again outside) among fast ones (which decide again inside): every increment lands once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_writers_decide_again_on_what_changed_and_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(store(&dir).await);
        store
            .put_all(&POLICY_REPORT, vec![report("hot", 0)])
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for w in 0..24u64 {
            let store = store.clone();
            let decision = Duration::from_millis(if w % 4 == 0 { 5 } else { 0 });
            tasks.push(tokio::spawn(async move {
                increment(&store, "hot", decision).await.resource_version
            }));
        }
        let mut versions = Vec::new();
        for task in tasks {
            versions.push(task.await.unwrap());
        }
        versions.sort_unstable();
        versions.dedup();
        assert_eq!(versions.len(), 24, "one version per write");
        let last = store
            .get_object(&POLICY_REPORT, "ns", "hot")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(count_of(&last), 24, "every increment landed once");
    }

    /// While the circuit is open a write is refused before any round touches the database
    /// (on a black-holed network a new connection would wait for its connect timeout), and
    /// nothing of it is stored.
    #[tokio::test]
    async fn a_write_while_the_circuit_is_open_is_refused_and_not_stored() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        // The store's probe (every 500 ms) may close the circuit again during an attempt, as
        // the database answers it: an attempt counts only if the circuit stayed open.
        for attempt in 0.. {
            assert!(
                attempt < 20,
                "the probe closed the circuit during every attempt"
            );
            let name = format!("refused-{attempt}");
            store.health().failed("no answer within 1s");
            let outcome = store
                .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &name, false, |_| {
                    Ok(Mutation::Put(report(&name, 0)))
                })
                .await;
            if !store.health().circuit_open() {
                continue;
            }
            assert!(
                matches!(outcome, Err(StoreError::Unavailable { .. })),
                "{outcome:?}"
            );
            store.health().answered();
            let stored = store.get_object(&POLICY_REPORT, "ns", &name).await;
            assert!(matches!(stored, Ok(None)), "{stored:?}");
            return;
        }
    }
}
