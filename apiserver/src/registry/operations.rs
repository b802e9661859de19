//! Each verb as one read-decide-write over the store: the rules in [`super::rules`] decide,
//! inside the store's write transaction, what the request does to the current object.

use std::sync::Arc;

use serde_json::Value;

use super::list::{ListPageStream, check_continue_version, check_list_version, list_query};
use super::patch::{ObjectLimits, PatchFailure, apply_json_patch, apply_merge_patch};
use super::rules::{
    DeletePreconditions, Validation, decide_apply, decide_delete, decide_update, prepare_create,
};
use super::{Admission, ListOptions, ListResult, RegistryError, ResourceRef};
use crate::store::write_target::Target;
use crate::store::{EventType, Mutation, Store, StoreError, write_target};
use reports_server_crds::ResourceDescriptor;

/// The object rules bound to a store and (behind kube-apiserver) an admission check.
#[derive(Clone)]
pub struct Registry {
    pub(super) store: Store,
    admission: Option<Arc<dyn Admission>>,
}

/// Objects a deletecollection deletes per transaction.
const DELETE_COLLECTION_BATCH: usize = 256;

/// How a write is made: on whose behalf, how strictly, and whether it is stored.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    pub dry_run: bool,
    /// The field manager recorded in `managedFields`.
    pub manager: String,
    pub validation: Validation,
    /// Bounds on the object the write builds (a patch's result).
    pub limits: ObjectLimits,
}

/// The result of a write: the object as stored (or as it would be, on a dry run).
#[derive(Debug)]
pub struct Written {
    /// `Null` when the write deleted the object (an update removing the last finalizer).
    pub object: Value,
    /// `object` as JSON when the store serialized it for the write (puts): a JSON response
    /// sends these bytes instead of serializing the object again.
    pub json: Option<bytes::Bytes>,
    /// `true` when the write created the object (server-side apply answers 201 then).
    pub created: bool,
    /// Field-validation warnings (`Warning` headers).
    pub warnings: Vec<String>,
}

/// What [`Registry::import`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Imported {
    /// Objects created or replaced.
    pub written: usize,
    /// Objects whose stored copy was already the same.
    pub unchanged: usize,
}

/// The batch targets of `keys` (namespace, name) of one kind.
fn targets_of<'a>(
    resource: &'static ResourceDescriptor,
    keys: &'a [(String, String)],
) -> Vec<Target<'a>> {
    keys.iter()
        .map(|(namespace, name)| Target {
            resource,
            namespace,
            name,
        })
        .collect()
}

/// The (namespace, name) of an object to import, checked against the kind's scope.
fn import_key(
    resource: &'static ResourceDescriptor,
    object: &Value,
) -> Result<(String, String), RegistryError> {
    let text = |field: &str| object["metadata"][field].as_str().unwrap_or("").to_owned();
    let (namespace, name) = (text("namespace"), text("name"));
    if name.is_empty() || object["metadata"]["uid"].as_str().unwrap_or("").is_empty() {
        return Err(RegistryError::bad_request(format!(
            "cannot import a {} without metadata.name and metadata.uid",
            resource.kind
        )));
    }
    if resource.namespaced == namespace.is_empty() {
        return Err(RegistryError::bad_request(format!(
            "cannot import {} {name:?}: namespace {namespace:?} does not fit a {} kind",
            resource.kind,
            if resource.namespaced {
                "namespaced"
            } else {
                "cluster-scoped"
            }
        )));
    }
    Ok((namespace, name))
}

/// Equal but for `metadata.resourceVersion`, which each storage assigns itself.
pub fn same_content(a: &Value, b: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(meta) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        v
    };
    strip(a) == strip(b)
}

/// A patch body that is not server-side apply.
pub enum Patch {
    /// RFC 7386 JSON merge patch.
    Merge(Value),
    /// RFC 6902 JSON patch.
    Json(json_patch::Patch),
}

/// Why an apply's decision did not produce a mutation.
enum ApplyFailure {
    Rejected(RegistryError),
    /// The object is missing: a create, which must pass admission first.
    NeedsAdmission,
}

impl From<StoreError> for ApplyFailure {
    fn from(e: StoreError) -> Self {
        ApplyFailure::Rejected(e.into())
    }
}

impl Registry {
    pub fn new(store: Store, admission: Option<Arc<dyn Admission>>) -> Self {
        Registry { store, admission }
    }

    pub async fn get(&self, r: &ResourceRef, name: &str) -> Result<Value, RegistryError> {
        self.store
            .get_object(r.resource, r.object_namespace(), name)
            .await?
            .ok_or_else(|| RegistryError::not_found(r.resource, name))
    }

    /// One page of a list. `metadata_only` reads no bodies (tables, metadata lists).
    pub async fn list(
        &self,
        r: &ResourceRef,
        options: &ListOptions,
        metadata_only: bool,
    ) -> Result<ListResult, RegistryError> {
        self.list_stream(r, options, metadata_only)
            .await?
            .collect()
            .await
    }

    /// [`Registry::list`], row by row. The request's `resourceVersion` is checked against the
    /// page's own snapshot before any row is read.
    pub async fn list_stream(
        &self,
        r: &ResourceRef,
        options: &ListOptions,
        metadata_only: bool,
    ) -> Result<ListPageStream, RegistryError> {
        let (query, fingerprint, token) = list_query(r, options, metadata_only)?;
        let rows = self.store.list_stream(&query).await?;
        check_list_version(options, rows.resource_version(), rows.compacted())?;
        check_continue_version(token.as_ref(), rows.resource_version())?;
        let resource_version = match &token {
            Some(t) => t.resource_version,
            None => rows.resource_version(),
        };
        Ok(ListPageStream::new(rows, resource_version, fingerprint))
    }

    pub async fn create(
        &self,
        r: &ResourceRef,
        object: Value,
        options: &WriteOptions,
    ) -> Result<Written, RegistryError> {
        let (object, name, warnings) =
            prepare_create(r, object, &options.validation, &options.manager)?;
        if let (Some(admission), Some(namespace)) = (&self.admission, &r.namespace) {
            admission.admit_create(namespace).await?;
        }
        let outcome = self
            .store
            .mutate_new(
                Target {
                    resource: r.resource,
                    namespace: r.object_namespace(),
                    name: &name,
                },
                options.dry_run,
                |current| {
                    if current.is_some() {
                        return Err(RegistryError::already_exists(r.resource, &name));
                    }
                    // Cloned: the decision is made again if a racing write lands first.
                    Ok(Mutation::Put(object.clone()))
                },
            )
            .await
            .map_err(|e: RegistryError| match e {
                // Two creates racing: the loser's insert hits the primary key.
                RegistryError::Store(StoreError::AlreadyExists) => {
                    RegistryError::already_exists(r.resource, &name)
                }
                e => e,
            })?;
        Ok(Written {
            object: outcome.object.unwrap_or(Value::Null),
            json: outcome.json,
            created: true,
            warnings,
        })
    }

    /// Stores objects copied from another storage (etcd-backed CRDs) exactly as they are there:
    /// uid, creationTimestamp, generation, labels, annotations, ownerReferences, finalizers and
    /// managedFields are kept, only our resourceVersion is assigned. An object whose stored copy
    /// already equals it (resourceVersion aside) is left alone, so copying again after a restart
    /// writes nothing twice. One transaction: all of `objects` or none.
    pub async fn import(
        &self,
        resource: &'static ResourceDescriptor,
        objects: Vec<Value>,
    ) -> Result<Imported, RegistryError> {
        let mut keys = Vec::with_capacity(objects.len());
        for object in &objects {
            keys.push(import_key(resource, object)?);
        }
        let targets = targets_of(resource, &keys);
        let outcomes = self
            .store
            .mutate_batch::<RegistryError, _>(&targets, false, |i, current| {
                let object = objects[i].clone();
                Ok(match current {
                    Some(current) if same_content(&current, &object) => Mutation::Unchanged,
                    _ => Mutation::Put(object),
                })
            })
            .await?;
        let written = outcomes.iter().filter(|o| o.event.is_some()).count();
        Ok(Imported {
            written,
            unchanged: outcomes.len() - written,
        })
    }

    /// Removes the objects at `keys` (namespace, name) in one transaction, whatever their
    /// finalizers: the copy is being brought in line with a source where they no longer exist.
    /// Returns how many existed.
    pub async fn remove(
        &self,
        resource: &'static ResourceDescriptor,
        keys: &[(String, String)],
    ) -> Result<usize, RegistryError> {
        let targets = targets_of(resource, keys);
        let outcomes = self
            .store
            .mutate_batch::<RegistryError, _>(&targets, false, |_, _| Ok(Mutation::Delete))
            .await?;
        Ok(outcomes.iter().filter(|o| o.event.is_some()).count())
    }

    pub async fn update(
        &self,
        r: &ResourceRef,
        name: &str,
        desired: Value,
        options: &WriteOptions,
    ) -> Result<Written, RegistryError> {
        self.rewrite(r, name, options, |_| Ok(desired.clone()))
            .await
    }

    pub async fn patch(
        &self,
        r: &ResourceRef,
        name: &str,
        patch: &Patch,
        options: &WriteOptions,
    ) -> Result<Written, RegistryError> {
        self.rewrite(r, name, options, |current| {
            let mut patched = current.clone();
            match patch {
                Patch::Json(p) => apply_json_patch(&mut patched, p, &options.limits),
                Patch::Merge(p) => apply_merge_patch(&mut patched, p, &options.limits),
            }
            .map_err(|failure| match failure {
                PatchFailure::Invalid(_) => RegistryError::invalid_field(
                    r.resource,
                    name,
                    "",
                    failure.to_string(),
                    "FieldValueInvalid",
                ),
                PatchFailure::TooLarge(message) => RegistryError::TooLarge(message),
            })?;
            Ok(patched)
        })
        .await
    }

    /// An update of the existing object to what `desired` makes of it (a PUT body ignores the
    /// current object; a patch applies to it), decided again if the object changes first.
    async fn rewrite(
        &self,
        r: &ResourceRef,
        name: &str,
        options: &WriteOptions,
        desired: impl Fn(&Value) -> Result<Value, RegistryError>,
    ) -> Result<Written, RegistryError> {
        let mut warnings = Vec::new();
        let outcome = self
            .store
            .mutate(
                r.resource,
                r.object_namespace(),
                name,
                options.dry_run,
                |current| {
                    let current =
                        current.ok_or_else(|| RegistryError::not_found(r.resource, name))?;
                    let desired = desired(&current)?;
                    let (mutation, _, w) = decide_update(
                        r,
                        name,
                        Some(current),
                        desired,
                        &options.validation,
                        &options.manager,
                    )?;
                    warnings = w;
                    Ok::<_, RegistryError>(mutation)
                },
            )
            .await?;
        Ok(Written {
            object: outcome.object.unwrap_or(Value::Null),
            json: outcome.json,
            created: false,
            warnings,
        })
    }

    /// Server-side apply: creates the object or merges the configuration into it.
    pub async fn apply(
        &self,
        r: &ResourceRef,
        name: &str,
        config: Value,
        force: bool,
        options: &WriteOptions,
    ) -> Result<Written, RegistryError> {
        // Admission (NamespaceLifecycle) runs for creates only, and cannot run under the store's
        // write lock: admit first when the object looks missing, and start over if it vanished
        // between the look and the write.
        let mut admitted = self.admission.is_none() || r.namespace.is_none();
        let mut warnings = Vec::new();
        let outcome = loop {
            if !admitted && let (Some(admission), Some(namespace)) = (&self.admission, &r.namespace)
            {
                let exists = self
                    .store
                    .get_object(r.resource, r.object_namespace(), name)
                    .await?
                    .is_some();
                if !exists {
                    admission.admit_create(namespace).await?;
                    admitted = true;
                }
            }
            let result = self
                .store
                .mutate(
                    r.resource,
                    r.object_namespace(),
                    name,
                    options.dry_run,
                    |current| {
                        if current.is_none() && !admitted {
                            return Err(ApplyFailure::NeedsAdmission);
                        }
                        let (mutation, w) = decide_apply(
                            r,
                            name,
                            current,
                            config.clone(),
                            &options.validation,
                            &options.manager,
                            force,
                        )
                        .map_err(ApplyFailure::Rejected)?;
                        warnings = w;
                        Ok(mutation)
                    },
                )
                .await;
            match result {
                Ok(outcome) => break outcome,
                Err(ApplyFailure::Rejected(e)) => return Err(e),
                Err(ApplyFailure::NeedsAdmission) => continue,
            }
        };
        Ok(Written {
            created: outcome.event == Some(EventType::Added),
            object: outcome.object.unwrap_or(Value::Null),
            json: outcome.json,
            warnings,
        })
    }

    /// Deletes the object, or marks it for deletion while finalizers remain. Returns the
    /// object as it was deleted or marked.
    pub async fn delete(
        &self,
        r: &ResourceRef,
        name: &str,
        preconditions: &DeletePreconditions,
    ) -> Result<Value, RegistryError> {
        let outcome = self
            .store
            .mutate(
                r.resource,
                r.object_namespace(),
                name,
                preconditions.dry_run,
                |current| decide_delete(r.resource, name, current, preconditions),
            )
            .await?;
        Ok(outcome.object.unwrap_or(Value::Null))
    }

    /// Deletes every object the selectors match, in transactions of
    /// [`DELETE_COLLECTION_BATCH`]. Returns the objects
    /// deleted or marked, and the store's resourceVersion after the write.
    pub async fn delete_collection(
        &self,
        r: &ResourceRef,
        selection: &ListOptions,
        preconditions: &DeletePreconditions,
    ) -> Result<(Vec<Value>, i64), RegistryError> {
        if selection.continue_token.is_some() || selection.limit.is_some() {
            return Err(RegistryError::bad_request(
                "deletecollection does not support limit or continue",
            ));
        }
        let (query, _, _) = list_query(r, selection, true)?;
        let page = self.store.list(&query).await?;
        let targets: Vec<write_target::Target<'_>> = page
            .rows
            .iter()
            .map(|row| write_target::Target {
                resource: r.resource,
                namespace: &row.namespace,
                name: &row.name,
            })
            .collect();
        let each = DeletePreconditions {
            dry_run: preconditions.dry_run,
            ..Default::default()
        };
        // In transactions of a bounded size, as kube-apiserver deletes one by one: a selection of
        // every report must not become one transaction that holds the store's write lock (and
        // every other writer) for as long as it takes.
        let mut items = Vec::new();
        for (batch, chunk) in targets.chunks(DELETE_COLLECTION_BATCH).enumerate() {
            let rows = &page.rows[batch * DELETE_COLLECTION_BATCH..];
            let outcomes = self
                .store
                .mutate_batch(chunk, preconditions.dry_run, |i, current| match current {
                    // Deleted by someone else since the list: nothing to do.
                    None => Ok(Mutation::Unchanged),
                    Some(c) => decide_delete(r.resource, &rows[i].name, Some(c), &each),
                })
                .await?;
            items.extend(outcomes.into_iter().filter_map(|o| o.event.and(o.object)));
        }
        let (current, _) = self.store.versions().await?;
        Ok((items, current))
    }
}
