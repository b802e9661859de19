//! Adoption of admission reports written before their resource had a UID, over the store.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use reports_server_aggregator::cluster::adoption::ReportsError;
use reports_server_aggregator::cluster::{EphemeralReports, Written};
use reports_server_aggregator::report::LABEL_RESOURCE_UID;
use serde_json::Value;

use crate::registry::{
    DeletePreconditions, FieldValidation, INTERNAL_MANAGER, RegistryError, ResourceRef, Validation,
    decide_delete, decide_update,
};
use crate::store::{Mutation, Store};

use super::{AggregationError, descriptor, ephemeral_kind};

/// The store's ephemeral reports, for adoption (`reports_server_aggregator::cluster::Adopter`): Kyverno's mutating webhook
/// writes its admission report before the object has a UID, so such a report names its
/// resource only by name and has neither an ownerReference nor a `resource.uid`. The adopter
/// looks the resource up in the cluster; the decision is written here, with the same
/// preconditions as an API write.
pub struct StoreEphemeralReports {
    store: Store,
}

impl StoreEphemeralReports {
    pub fn new(store: Store) -> Self {
        StoreEphemeralReports { store }
    }

    /// Applies `change` to the report if it still has the `uid` and `resourceVersion` it was
    /// listed with.
    async fn write(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        change: impl Fn(&ResourceRef, &str, Value) -> Result<Mutation, RegistryError> + Send,
    ) -> Result<Written, ReportsError> {
        let desc = descriptor(ephemeral_kind(namespace));
        let name = report.name.clone().unwrap_or_default();
        let path = ResourceRef::new(desc, namespace);
        let mut written = Written::Done;
        let outcome = self
            .store
            .mutate::<AggregationError, _>(desc, namespace, &name, false, |current| {
                // Decided again if the report changes before the write: only the last counts.
                written = Written::Done;
                let Some(current) = current else {
                    written = Written::Gone;
                    return Ok(Mutation::Unchanged);
                };
                let meta = &current["metadata"];
                if meta["uid"].as_str() != report.uid.as_deref()
                    || meta["resourceVersion"].as_str() != report.resource_version.as_deref()
                {
                    written = Written::Changed;
                    return Ok(Mutation::Unchanged);
                }
                change(&path, &name, current).map_err(|e| {
                    if e.is_conflict() {
                        AggregationError::Conflict(e.to_string())
                    } else {
                        AggregationError::Invalid {
                            kind: ephemeral_kind(namespace),
                            namespace: namespace.to_owned(),
                            name: name.clone(),
                            message: e.to_string(),
                        }
                    }
                })
            })
            .await;
        match outcome {
            Ok(_) => Ok(written),
            Err(AggregationError::Conflict(_)) => Ok(Written::Changed),
            Err(e) => Err(Box::new(e)),
        }
    }
}

impl EphemeralReports for StoreEphemeralReports {
    async fn unowned(&self, namespace: &str) -> Result<Vec<ObjectMeta>, ReportsError> {
        let desc = descriptor(ephemeral_kind(namespace));
        let mut unowned = Vec::new();
        for meta in self.store.unowned_metadata(desc, namespace).await? {
            unowned.push(serde_json::from_value::<ObjectMeta>(meta)?);
        }
        Ok(unowned)
    }

    async fn adopt(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        owner: &OwnerReference,
    ) -> Result<Written, ReportsError> {
        let owner_value = serde_json::to_value(owner)?;
        self.write(namespace, report, |path, name, current| {
            let mut adopted = current.clone();
            adopted["metadata"]["ownerReferences"] = Value::Array(vec![owner_value.clone()]);
            adopted["metadata"]["labels"][LABEL_RESOURCE_UID] = Value::String(owner.uid.clone());
            let validation = Validation {
                mode: FieldValidation::Ignore,
                duplicates: Vec::new(),
            };
            decide_update(
                path,
                name,
                Some(current),
                adopted,
                &validation,
                INTERNAL_MANAGER,
            )
            .map(|(m, _, _)| m)
        })
        .await
    }

    async fn delete(&self, namespace: &str, report: &ObjectMeta) -> Result<Written, ReportsError> {
        let preconditions = DeletePreconditions {
            uid: report.uid.clone(),
            resource_version: report.resource_version.clone(),
            dry_run: false,
        };
        self.write(namespace, report, |path, name, current| {
            decide_delete(path.resource, name, Some(current), &preconditions)
        })
        .await
    }
}
