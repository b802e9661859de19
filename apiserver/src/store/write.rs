//! Writes. Every write runs in one transaction that (1) takes the resourceVersion counter's row
//! lock, (2) reads the current object, (3) lets the caller decide the new state from it, (4)
//! writes the object, its labels and its result rows, and (5) appends to the change log. Because
//! the caller's decision happens under the lock, read-modify-write requests (patch, apply,
//! finalizer removal) never race and never need a retry loop.

use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict, Query};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, TransactionTrait};
use serde_json::Value;

use super::columns::{ObjectColumns, result_rows};
use super::feed::EventType;
use super::schema::{Changes, ObjectLabels, Objects, Results, StoreState};
use super::{Store, StoreError, parse_document};

/// What a write does to one object, decided from its current state.
#[derive(Debug)]
pub enum Mutation {
    /// Create or replace with this object (its `metadata.resourceVersion` is set by the store).
    Put(Value),
    /// Remove the object.
    Delete,
    /// Leave it as it is (a no-op update does not bump the resourceVersion).
    Unchanged,
}

/// The result of a write to one object.
#[derive(Debug, Clone)]
pub struct WriteOutcome {
    /// The object as stored (for deletes: its last state).
    pub object: Option<Value>,
    pub event: Option<EventType>,
    pub resource_version: i64,
}

/// One object a batch touches.
pub struct Target<'a> {
    pub resource: &'static ResourceDescriptor,
    pub namespace: &'a str,
    pub name: &'a str,
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Store {
    /// Reads the object at `namespace/name`, lets `decide` choose what to do, and does it.
    pub async fn mutate<E, F>(
        &self,
        resource: &'static ResourceDescriptor,
        namespace: &str,
        name: &str,
        dry_run: bool,
        decide: F,
    ) -> Result<WriteOutcome, E>
    where
        E: From<StoreError>,
        F: FnOnce(Option<Value>) -> Result<Mutation, E>,
    {
        let mut decide = Some(decide);
        let mut outcomes = self
            .mutate_batch(
                &[Target {
                    resource,
                    namespace,
                    name,
                }],
                dry_run,
                |_, current| (decide.take().expect("called once per target"))(current),
            )
            .await?;
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
        let mut objects: Vec<Option<Value>> = objects.into_iter().map(Some).collect();
        let outcomes = self
            .mutate_batch::<StoreError, _>(&targets, false, |i, _| {
                Ok(Mutation::Put(
                    objects[i].take().expect("one decision per target"),
                ))
            })
            .await?;
        Ok(outcomes.last().map_or(0, |o| o.resource_version))
    }

    /// Applies a decision to each target in one transaction: all of them or none.
    pub async fn mutate_batch<E, F>(
        &self,
        targets: &[Target<'_>],
        dry_run: bool,
        mut decide: F,
    ) -> Result<Vec<WriteOutcome>, E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        if dry_run {
            let mut outcomes = Vec::with_capacity(targets.len());
            for (i, t) in targets.iter().enumerate() {
                let current = self.get_object(t.resource, t.namespace, t.name).await?;
                let rv = current.as_ref().and_then(current_rv).unwrap_or(0);
                outcomes.push(match decide(i, current.clone())? {
                    Mutation::Put(object) => WriteOutcome {
                        event: Some(if current.is_some() {
                            EventType::Modified
                        } else {
                            EventType::Added
                        }),
                        object: Some(object),
                        resource_version: rv,
                    },
                    Mutation::Delete => WriteOutcome {
                        object: current,
                        event: Some(EventType::Deleted),
                        resource_version: rv,
                    },
                    Mutation::Unchanged => WriteOutcome {
                        object: current,
                        event: None,
                        resource_version: rv,
                    },
                });
            }
            return Ok(outcomes);
        }

        let _guard = self.write_lock.lock().await;
        let txn = self.connection().begin().await.map_err(StoreError::from)?;
        let result = self.write_in(&txn, targets, &mut decide).await;
        match result {
            Ok((outcomes, changed)) => {
                txn.commit().await.map_err(StoreError::from)?;
                if changed {
                    self.feed().wake();
                }
                Ok(outcomes)
            }
            Err(e) => {
                txn.rollback().await.ok();
                Err(e)
            }
        }
    }

    async fn write_in<E, F>(
        &self,
        txn: &DatabaseTransaction,
        targets: &[Target<'_>],
        decide: &mut F,
    ) -> Result<(Vec<WriteOutcome>, bool), E>
    where
        E: From<StoreError>,
        F: FnMut(usize, Option<Value>) -> Result<Mutation, E>,
    {
        // Take the counter's row lock first: it orders this transaction against every other
        // writer, in this process or another one.
        txn.execute(
            &Query::update()
                .table(StoreState::Table)
                .value(StoreState::Rv, Expr::col(StoreState::Rv))
                .and_where(Expr::col(StoreState::ClusterId).eq(self.cluster_id()))
                .to_owned(),
        )
        .await
        .map_err(StoreError::from)?;
        let (base_rv, _) = super::read::versions(txn, self.backend(), self.cluster_id()).await?;
        let mut rv = base_rv;
        let mut outcomes = Vec::with_capacity(targets.len());
        let now = now_unix();
        for (i, target) in targets.iter().enumerate() {
            let key = Store::resource_key(target.resource);
            let current = self.locked_current(txn, &key, target).await?;
            let current_object = match &current {
                Some((_, body)) => Some(parse_document(
                    &format!("{}/{}", target.namespace, target.name),
                    body,
                )?),
                None => None,
            };
            let outcome = match decide(i, current_object.clone())? {
                Mutation::Unchanged => WriteOutcome {
                    resource_version: current_object.as_ref().and_then(current_rv).unwrap_or(0),
                    object: current_object,
                    event: None,
                },
                Mutation::Put(mut object) => {
                    rv += 1;
                    object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
                    let event = match current {
                        Some((id, _)) => {
                            self.update_row(txn, id, target, &object, rv).await?;
                            EventType::Modified
                        }
                        None => {
                            self.insert_row(txn, &key, target, &object, rv).await?;
                            EventType::Added
                        }
                    };
                    self.append_change(
                        txn,
                        &key,
                        target,
                        event,
                        &object,
                        current_object.as_ref(),
                        rv,
                        now,
                    )
                    .await?;
                    WriteOutcome {
                        object: Some(object),
                        event: Some(event),
                        resource_version: rv,
                    }
                }
                Mutation::Delete => match (current, current_object) {
                    (Some((id, _)), Some(mut object)) => {
                        rv += 1;
                        self.delete_row(txn, id).await?;
                        object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
                        let previous = object.clone();
                        self.append_change(
                            txn,
                            &key,
                            target,
                            EventType::Deleted,
                            &object,
                            Some(&previous),
                            rv,
                            now,
                        )
                        .await?;
                        WriteOutcome {
                            object: Some(object),
                            event: Some(EventType::Deleted),
                            resource_version: rv,
                        }
                    }
                    _ => WriteOutcome {
                        object: None,
                        event: None,
                        resource_version: base_rv,
                    },
                },
            };
            outcomes.push(outcome);
        }
        if rv != base_rv {
            txn.execute(
                &Query::update()
                    .table(StoreState::Table)
                    .value(StoreState::Rv, rv)
                    .and_where(Expr::col(StoreState::ClusterId).eq(self.cluster_id()))
                    .to_owned(),
            )
            .await
            .map_err(StoreError::from)?;
            if self.backend() == DbBackend::Postgres {
                txn.execute_unprepared(&format!("NOTIFY reports_server_changes, '{rv}'"))
                    .await
                    .map_err(StoreError::from)?;
            }
        }
        Ok((outcomes, rv != base_rv))
    }

    async fn locked_current(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        t: &Target<'_>,
    ) -> Result<Option<(i64, String)>, StoreError> {
        let row = txn
            .query_one(
                &Query::select()
                    .columns([Objects::Id, Objects::Body])
                    .from(Objects::Table)
                    .and_where(Expr::col(Objects::ClusterId).eq(self.cluster_id()))
                    .and_where(Expr::col(Objects::Resource).eq(key))
                    .and_where(Expr::col(Objects::Namespace).eq(t.namespace))
                    .and_where(Expr::col(Objects::Name).eq(t.name))
                    .to_owned(),
            )
            .await?;
        match row {
            Some(r) => Ok(Some((r.try_get("", "id")?, r.try_get("", "body")?))),
            None => Ok(None),
        }
    }

    async fn insert_row(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        t: &Target<'_>,
        object: &Value,
        rv: i64,
    ) -> Result<(), StoreError> {
        let cols = ObjectColumns::of(t.resource, object);
        let mut insert = Query::insert();
        insert
            .into_table(Objects::Table)
            .columns([
                Objects::ClusterId,
                Objects::Resource,
                Objects::Namespace,
                Objects::Name,
                Objects::Uid,
                Objects::ResourceVersion,
                Objects::Generation,
                Objects::CreatedAt,
                Objects::DeletedAt,
                Objects::OwnerUids,
                Objects::SummaryPass,
                Objects::SummaryFail,
                Objects::SummaryWarn,
                Objects::SummaryError,
                Objects::SummarySkip,
                Objects::ScopeKind,
                Objects::ScopeNamespace,
                Objects::ScopeName,
                Objects::ScopeUid,
                Objects::Metadata,
                Objects::Body,
            ])
            .values_panic([
                self.cluster_id().into(),
                key.into(),
                t.namespace.into(),
                t.name.into(),
                cols.uid.clone().into(),
                rv.into(),
                cols.generation.into(),
                cols.created_at.into(),
                cols.deleted_at.into(),
                cols.owner_uids.clone().into(),
                cols.summary[0].into(),
                cols.summary[1].into(),
                cols.summary[2].into(),
                cols.summary[3].into(),
                cols.summary[4].into(),
                cols.scope_kind.clone().into(),
                cols.scope_namespace.clone().into(),
                cols.scope_name.clone().into(),
                cols.scope_uid.clone().into(),
                cols.metadata.clone().into(),
                object.to_string().into(),
            ]);
        let id: i64 = if self.backend() == DbBackend::MySql {
            let res = txn.execute(&insert).await.map_err(unique_to_exists)?;
            res.last_insert_id() as i64
        } else {
            insert.returning_col(Objects::Id);
            let row = txn.query_one(&insert).await.map_err(unique_to_exists)?;
            row.ok_or_else(|| {
                StoreError::Inconsistent("INSERT … RETURNING returned no row".into())
            })?
            .try_get("", "id")?
        };
        self.write_side_rows(txn, id, key, t, object, &cols).await
    }

    async fn update_row(
        &self,
        txn: &DatabaseTransaction,
        id: i64,
        t: &Target<'_>,
        object: &Value,
        rv: i64,
    ) -> Result<(), StoreError> {
        let cols = ObjectColumns::of(t.resource, object);
        txn.execute(
            &Query::update()
                .table(Objects::Table)
                .values([
                    (Objects::Uid, cols.uid.clone().into()),
                    (Objects::ResourceVersion, rv.into()),
                    (Objects::Generation, cols.generation.into()),
                    (Objects::CreatedAt, cols.created_at.into()),
                    (Objects::DeletedAt, cols.deleted_at.into()),
                    (Objects::OwnerUids, cols.owner_uids.clone().into()),
                    (Objects::SummaryPass, cols.summary[0].into()),
                    (Objects::SummaryFail, cols.summary[1].into()),
                    (Objects::SummaryWarn, cols.summary[2].into()),
                    (Objects::SummaryError, cols.summary[3].into()),
                    (Objects::SummarySkip, cols.summary[4].into()),
                    (Objects::ScopeKind, cols.scope_kind.clone().into()),
                    (Objects::ScopeNamespace, cols.scope_namespace.clone().into()),
                    (Objects::ScopeName, cols.scope_name.clone().into()),
                    (Objects::ScopeUid, cols.scope_uid.clone().into()),
                    (Objects::Metadata, cols.metadata.clone().into()),
                    (Objects::Body, object.to_string().into()),
                ])
                .and_where(Expr::col(Objects::Id).eq(id))
                .to_owned(),
        )
        .await?;
        self.delete_side_rows(txn, id).await?;
        let key = Store::resource_key(t.resource);
        self.write_side_rows(txn, id, &key, t, object, &cols).await
    }

    async fn delete_row(&self, txn: &DatabaseTransaction, id: i64) -> Result<(), StoreError> {
        txn.execute(
            &Query::delete()
                .from_table(Objects::Table)
                .and_where(Expr::col(Objects::Id).eq(id))
                .to_owned(),
        )
        .await?;
        self.delete_side_rows(txn, id).await
    }

    async fn delete_side_rows(&self, txn: &DatabaseTransaction, id: i64) -> Result<(), StoreError> {
        txn.execute(
            &Query::delete()
                .from_table(ObjectLabels::Table)
                .and_where(Expr::col(ObjectLabels::ObjectId).eq(id))
                .to_owned(),
        )
        .await?;
        txn.execute(
            &Query::delete()
                .from_table(Results::Table)
                .and_where(Expr::col(Results::ObjectId).eq(id))
                .to_owned(),
        )
        .await?;
        Ok(())
    }

    async fn write_side_rows(
        &self,
        txn: &DatabaseTransaction,
        id: i64,
        key: &str,
        t: &Target<'_>,
        object: &Value,
        cols: &ObjectColumns,
    ) -> Result<(), StoreError> {
        if !cols.labels.is_empty() {
            let mut insert = Query::insert();
            insert.into_table(ObjectLabels::Table).columns([
                ObjectLabels::ObjectId,
                ObjectLabels::Key,
                ObjectLabels::Value,
            ]);
            for (k, v) in &cols.labels {
                insert.values_panic([id.into(), k.clone().into(), v.clone().into()]);
            }
            txn.execute(&insert).await?;
        }
        let rows = result_rows(t.resource, object);
        // Stay far below every backend's bind-parameter limit (SQLite 32766, Postgres 65535).
        for chunk in rows.chunks(1000) {
            let mut insert = Query::insert();
            insert.into_table(Results::Table).columns([
                Results::ObjectId,
                Results::ClusterId,
                Results::Resource,
                Results::Namespace,
                Results::ReportName,
                Results::Source,
                Results::Policy,
                Results::Rule,
                Results::Result,
                Results::Severity,
                Results::Category,
                Results::Scored,
                Results::SubjectApiVersion,
                Results::SubjectKind,
                Results::SubjectNamespace,
                Results::SubjectName,
                Results::SubjectUid,
                Results::Timestamp,
                Results::Message,
                Results::Properties,
            ]);
            for r in chunk {
                insert.values_panic([
                    id.into(),
                    self.cluster_id().into(),
                    key.into(),
                    t.namespace.into(),
                    t.name.into(),
                    r.source.clone().into(),
                    r.policy.clone().into(),
                    r.rule.clone().into(),
                    r.result.clone().into(),
                    r.severity.clone().into(),
                    r.category.clone().into(),
                    r.scored.into(),
                    r.subject_api_version.clone().into(),
                    r.subject_kind.clone().into(),
                    r.subject_namespace.clone().into(),
                    r.subject_name.clone().into(),
                    r.subject_uid.clone().into(),
                    r.timestamp.into(),
                    r.message.clone().into(),
                    r.properties.clone().into(),
                ]);
            }
            txn.execute(&insert).await?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn append_change(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        t: &Target<'_>,
        event: EventType,
        object: &Value,
        previous: Option<&Value>,
        rv: i64,
        now: i64,
    ) -> Result<(), StoreError> {
        let labels_of = |o: &Value| {
            o["metadata"]
                .get("labels")
                .cloned()
                .unwrap_or(Value::Object(Default::default()))
        };
        let labels = labels_of(object);
        // Watches with a label selector need the old labels to turn "stopped matching" into
        // DELETED and "started matching" into ADDED, as kube-apiserver does.
        let prev_labels = previous.map(labels_of).unwrap_or(Value::Null);
        txn.execute(
            &Query::insert()
                .into_table(Changes::Table)
                .columns([
                    Changes::ClusterId,
                    Changes::Rv,
                    Changes::Resource,
                    Changes::Namespace,
                    Changes::Name,
                    Changes::EventType,
                    Changes::Labels,
                    Changes::PrevLabels,
                    Changes::Body,
                    Changes::CreatedAt,
                ])
                .values_panic([
                    self.cluster_id().into(),
                    rv.into(),
                    key.into(),
                    t.namespace.into(),
                    t.name.into(),
                    event.as_str().into(),
                    labels.to_string().into(),
                    prev_labels.to_string().into(),
                    object.to_string().into(),
                    now.into(),
                ])
                .on_conflict(OnConflict::new().do_nothing().to_owned())
                .to_owned(),
        )
        .await?;
        Ok(())
    }
}

/// The primary key already taken: the driver's unique-violation code, not its wording.
fn unique_to_exists(e: sea_orm::DbErr) -> StoreError {
    if matches!(
        e.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    ) {
        StoreError::AlreadyExists
    } else {
        e.into()
    }
}

fn current_rv(object: &Value) -> Option<i64> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
}

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
    let _guard = store.write_lock.lock().await;
    let txn = store.connection().begin().await?;
    txn.execute(
        &Query::delete()
            .from_table(Changes::Table)
            .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(Changes::Rv).lte(horizon))
            .to_owned(),
    )
    .await?;
    txn.execute(
        &Query::update()
            .table(StoreState::Table)
            .value(StoreState::CompactedRv, horizon)
            .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(StoreState::CompactedRv).lt(horizon))
            .to_owned(),
    )
    .await?;
    txn.commit().await?;
    Ok(horizon)
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
    let _guard = store.write_lock.lock().await;
    let txn = store.connection().begin().await?;
    // The counter's row lock orders this against writers in other processes too.
    txn.execute(
        &Query::update()
            .table(StoreState::Table)
            .value(StoreState::Rv, Expr::col(StoreState::Rv))
            .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
            .to_owned(),
    )
    .await?;
    let (current, compacted) =
        super::read::versions(&txn, store.backend(), store.cluster_id()).await?;
    let (current, compacted) = (
        std::cmp::max(current, floor),
        std::cmp::max(compacted, floor),
    );
    txn.execute(
        &Query::delete()
            .from_table(Changes::Table)
            .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(Changes::Rv).lte(compacted))
            .to_owned(),
    )
    .await?;
    txn.execute(
        &Query::update()
            .table(StoreState::Table)
            .value(StoreState::Rv, current)
            .value(StoreState::CompactedRv, compacted)
            .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
            .to_owned(),
    )
    .await?;
    txn.commit().await?;
    Ok((current, compacted))
}
