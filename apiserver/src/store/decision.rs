//! What a writer decides and what a round makes of it, without I/O: the mutation of one
//! object ([`Mutation`]), the decision with the state it was made on ([`Decided`]), the
//! resourceVersion a round gives it ([`version`]) and the outcome the writer sees.
//!
//! Both the writer's side (`mutate`) and the round's (`group_commit`, `write`) speak these
//! types, so they live apart from both.

use reports_server_crds::ResourceDescriptor;
use serde_json::Value;

use super::feed::EventType;
use super::prepared::{Prepared, RowParts};
use super::result_diff::{ResultColumns, StoredRows};

/// A target's stored row as a writer read it.
pub(super) struct Seen {
    pub(super) id: i64,
    pub(super) rv: i64,
    pub(super) body: String,
}

/// The `results` rows (with their slots) of the report `id` at version `rv`, read by a writer
/// that replaces it: the round diffs the replacement against them when the report is still at
/// `rv`, instead of reading them under the counter's lock. Sound because a report's rows change
/// only in the commit that changes its version, and the writer reads them after the version.
pub(super) struct StoredResults {
    pub(super) id: i64,
    pub(super) rv: i64,
    pub(super) rows: Vec<(i32, ResultColumns)>,
}

/// The resourceVersion an object carries in its metadata.
pub(super) fn current_rv(object: &Value) -> Option<i64> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
}

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
    /// `object` as JSON, when the write serialized it anyway (puts): the response reuses it.
    pub json: Option<bytes::Bytes>,
    pub event: Option<EventType>,
    pub resource_version: i64,
}

/// One object a batch touches.
pub struct Target<'a> {
    pub resource: &'static ResourceDescriptor,
    pub namespace: &'a str,
    pub name: &'a str,
}

/// The stored state of the object a write targets, read under the counter's row lock.
pub(super) struct Current {
    pub(super) id: i64,
    pub(super) rv: i64,
    /// What the round knows of the object's `results` rows when it replaces the object
    /// (nothing otherwise): what the replacement's rows are diffed against.
    pub(super) stored_results: StoredRows,
}

/// A writer's decision on one target, with the current object it was made on.
pub(super) struct Decided {
    pub(super) mutation: Mutation,
    pub(super) current: Option<Value>,
    /// The put's row but for its version, prepared by the writer (see [`super::prepared`]);
    /// taken by the round that writes it (a retry computes it again).
    pub(super) prepared: Option<Prepared>,
    /// No result row stored for `current` can stay in the put (see
    /// [`super::result_diff::none_can_stay`]): the round need not read them.
    pub(super) none_stay: bool,
}

/// A decided mutation with its resourceVersion assigned (the object stamped with it): what
/// [`Store::apply_one`] writes at once and [`Store::stage`] leaves to [`Store::write_staged`].
// One lives briefly per write and is matched at once: boxing the row would only add an
// allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Versioned<'a> {
    /// Nothing to write: the object is unchanged, or a delete found nothing.
    Nothing(Applied),
    /// A create, or the replacement of the row `replaces`.
    Put {
        event: EventType,
        parts: RowParts,
        object: &'a Value,
        previous: Option<&'a Value>,
        replaces: Option<&'a Current>,
    },
    /// The removal of `current`; `object` is its last state, with the deletion's version.
    Delete {
        current: &'a Current,
        object: &'a Value,
    },
}

/// Gives `decided` the next resourceVersion after `rv` (advancing it) when it writes
/// something; `base_rv` is the round's starting version.
pub(super) fn version<'a>(
    target: &Target<'_>,
    current: Option<&'a Current>,
    decided: &'a mut Decided,
    rv: &mut i64,
    base_rv: i64,
) -> Versioned<'a> {
    let Decided {
        mutation,
        current: current_object,
        prepared,
        none_stay: _,
    } = decided;
    match (mutation, current, current_object.as_mut()) {
        (Mutation::Unchanged, _, previous) => Versioned::Nothing(Applied {
            event: None,
            resource_version: previous.as_deref().and_then(current_rv).unwrap_or(0),
            json: None,
        }),
        (Mutation::Put(object), replaces, previous) => {
            *rv += 1;
            object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
            Versioned::Put {
                event: match replaces {
                    Some(_) => EventType::Modified,
                    None => EventType::Added,
                },
                parts: RowParts::of(target.resource, object, *rv, prepared.take()),
                object,
                previous: previous.map(|p| &*p),
                replaces,
            }
        }
        (Mutation::Delete, Some(current), Some(object)) => {
            *rv += 1;
            object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
            Versioned::Delete { current, object }
        }
        (Mutation::Delete, ..) => Versioned::Nothing(Applied {
            event: None,
            resource_version: base_rv,
            json: None,
        }),
    }
}

/// What a round did with one decision.
pub(super) struct Applied {
    pub(super) event: Option<EventType>,
    pub(super) resource_version: i64,
    /// The object as written, as JSON with its resourceVersion (puts only): serialized once
    /// for the row, then shared by the feed and the writer's response.
    pub(super) json: Option<bytes::Bytes>,
}

impl Applied {
    pub(super) fn put(event: EventType, rv: i64, parts: &RowParts) -> Self {
        Applied {
            event: Some(event),
            resource_version: rv,
            json: Some(parts.json()),
        }
    }

    pub(super) fn deleted(rv: i64) -> Self {
        Applied {
            event: Some(EventType::Deleted),
            resource_version: rv,
            json: None,
        }
    }
}

impl Decided {
    /// Whether this is a put of a report that keeps `results` rows: what a replacement's rows
    /// are diffed for.
    pub(super) fn puts_result_rows(&self, resource: &ResourceDescriptor) -> bool {
        matches!(self.mutation, Mutation::Put(_)) && super::columns::has_result_rows(resource)
    }

    /// The outcome the writer sees: the object as written (a delete's last state, with the
    /// deletion's resourceVersion), or as it was when nothing changed.
    pub(super) fn into_outcome(self, applied: Applied) -> WriteOutcome {
        let object = match self.mutation {
            Mutation::Put(object) => Some(object),
            Mutation::Delete | Mutation::Unchanged => self.current,
        };
        WriteOutcome {
            object,
            json: applied.json,
            event: applied.event,
            resource_version: applied.resource_version,
        }
    }
}
