//! Patches applied with bounded work (pure).
//!
//! A request body is parsed with a nesting limit, but a JSON patch *builds* a document: a few
//! hundred `add`/`move` operations of a few bytes each nest it a level deeper every time, and a
//! dozen `copy` operations double it a dozen times. Everything downstream of the patch (pruning,
//! serializing, even dropping the `Value`) recurses once per level, so a deep enough result
//! overflows the stack and kills the process, and a doubled one takes hundreds of MiB. So the
//! limits are checked where the document grows — before each operation is applied, from the
//! operation's own path and value — not once on the body:
//!
//! * at most [`MAX_JSON_PATCH_OPERATIONS`] operations (kube-apiserver's figure);
//! * no document deeper than [`MAX_DEPTH`], the body parser's limit, so whatever is stored
//!   parses again when read;
//! * the bytes `copy` duplicates and `move` relocates add up to at most the request body limit
//!   (kube-apiserver bounds `copy` the same way, with its `AccumulatedCopySizeLimit`);
//! * the result at most [`ObjectLimits::max_object_bytes`].
//!
//! A merge patch cannot nest deeper than its inputs nor grow beyond their sum, so only the
//! result's size is checked.

use json_patch::PatchOperation;
use serde_json::Value;

/// kube-apiserver's `maxJSONPatchOperations`.
pub const MAX_JSON_PATCH_OPERATIONS: usize = 10_000;

/// Nesting of arrays and objects in any document the server builds: serde_json's recursion
/// limit for the request bodies, so a stored object always parses again.
pub const MAX_DEPTH: usize = 128;

/// Bounds on the documents a write may produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectLimits {
    /// The largest object a write may store, as serialized JSON (the request body limit).
    pub max_object_bytes: usize,
}

/// The largest object by default: 8 MiB, twice the 4 MB vulnerability reports that outgrow
/// etcd's 1.5 MiB, and a statement well inside MariaDB's default `max_allowed_packet` (16 MiB).
pub const DEFAULT_MAX_OBJECT_BYTES: usize = 8 * 1024 * 1024;

impl Default for ObjectLimits {
    fn default() -> Self {
        ObjectLimits {
            max_object_bytes: DEFAULT_MAX_OBJECT_BYTES,
        }
    }
}

/// Why a patch was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchFailure {
    /// The patch itself is invalid or does not apply (a failed `test`, a missing path).
    #[error("the JSON patch could not be applied: {0}")]
    Invalid(String),
    /// The patch or its result is beyond a limit: 413 Request Entity Too Large.
    #[error("{0}")]
    TooLarge(String),
}

/// The size and nesting of a document, measured without recursion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Measure {
    /// Nesting of arrays and objects: 0 for a scalar, 1 for `{}` or `[1]`.
    pub depth: usize,
    /// The length of its compact JSON, counting each string's bytes once (escapes ignored).
    pub bytes: usize,
}

/// Measures `value` with an explicit stack, so a document of any depth is measured safely.
pub fn measure(value: &Value) -> Measure {
    let mut result = Measure::default();
    let mut stack: Vec<(&Value, usize)> = vec![(value, 0)];
    while let Some((value, level)) = stack.pop() {
        result.bytes += match value {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(n) => number_length(n),
            Value::String(s) => s.len() + 2,
            Value::Array(items) => {
                result.depth = result.depth.max(level + 1);
                stack.extend(items.iter().map(|item| (item, level + 1)));
                2 + items.len().saturating_sub(1)
            }
            Value::Object(map) => {
                result.depth = result.depth.max(level + 1);
                stack.extend(map.values().map(|item| (item, level + 1)));
                2 + map.len().saturating_sub(1) + map.keys().map(|k| k.len() + 3).sum::<usize>()
            }
        };
    }
    result
}

fn number_length(n: &serde_json::Number) -> usize {
    if let Some(u) = n.as_u64() {
        u.checked_ilog10().unwrap_or(0) as usize + 1
    } else if let Some(i) = n.as_i64() {
        i.unsigned_abs().checked_ilog10().unwrap_or(0) as usize + 2
    } else {
        // The longest shortest-round-trip form of an f64.
        24
    }
}

/// Applies an RFC 6902 patch to `doc` within `limits`. On an error `doc` is left part-patched:
/// callers patch a copy and drop it.
pub fn apply_json_patch(
    doc: &mut Value,
    operations: &[PatchOperation],
    limits: &ObjectLimits,
) -> Result<(), PatchFailure> {
    if operations.len() > MAX_JSON_PATCH_OPERATIONS {
        return Err(PatchFailure::TooLarge(format!(
            "The allowed maximum operations in a JSON patch is {MAX_JSON_PATCH_OPERATIONS}, got {}",
            operations.len()
        )));
    }
    // An upper bound of the document's depth, kept without walking it after every operation.
    let mut depth_bound = measure(doc).depth;
    // Bytes that `copy` duplicated and `move` walked.
    let mut moved_bytes = 0usize;
    for (index, operation) in operations.iter().enumerate() {
        let path_len = operation.path().count();
        let inserted = match operation {
            PatchOperation::Add(op) => Some(measure(&op.value)),
            PatchOperation::Replace(op) => Some(measure(&op.value)),
            PatchOperation::Copy(op) => {
                let copied = subtree(doc, &op.from, index)?;
                moved_bytes += copied.bytes;
                Some(copied)
            }
            PatchOperation::Move(op) => {
                // The moved value sits `from.count()` levels down, so it is at most that much
                // shallower than the document; measure it only when that bound is not enough.
                let bound = depth_bound.saturating_sub(op.from.count());
                if path_len + bound <= MAX_DEPTH {
                    depth_bound = depth_bound.max(path_len + bound);
                    None
                } else {
                    let moved = subtree(doc, &op.from, index)?;
                    moved_bytes += moved.bytes;
                    Some(moved)
                }
            }
            PatchOperation::Remove(_) | PatchOperation::Test(_) => None,
        };
        if let Some(inserted) = inserted {
            if path_len + inserted.depth > MAX_DEPTH {
                return Err(PatchFailure::Invalid(format!(
                    "operation {index} ({}) would nest the object {} levels deep; at most {MAX_DEPTH} are allowed",
                    operation_name(operation),
                    path_len + inserted.depth
                )));
            }
            depth_bound = depth_bound.max(path_len + inserted.depth);
        }
        // With this budget the document never exceeds its start plus the body plus the
        // budget, so checking its size once, at the end, bounds memory too.
        if moved_bytes > limits.max_object_bytes {
            return Err(PatchFailure::TooLarge(format!(
                "the JSON patch's copy and move operations handle more than {} bytes in all (operation {index})",
                limits.max_object_bytes
            )));
        }
        json_patch::patch_unsafe(doc, std::slice::from_ref(operation)).map_err(|e| {
            PatchFailure::Invalid(format!(
                "operation {index} ({}) failed at path '{}': {}",
                operation_name(operation),
                e.path,
                e.kind
            ))
        })?;
    }
    check_size(doc, limits)
}

/// Applies an RFC 7386 merge patch within `limits`.
pub fn apply_merge_patch(
    doc: &mut Value,
    patch: &Value,
    limits: &ObjectLimits,
) -> Result<(), PatchFailure> {
    json_patch::merge(doc, patch);
    check_size(doc, limits)
}

/// Refuses a document larger than the limit.
pub fn check_size(doc: &Value, limits: &ObjectLimits) -> Result<(), PatchFailure> {
    let bytes = measure(doc).bytes;
    if bytes > limits.max_object_bytes {
        return Err(PatchFailure::TooLarge(format!(
            "the patched object would be about {bytes} bytes; at most {} are allowed",
            limits.max_object_bytes
        )));
    }
    Ok(())
}

fn subtree(
    doc: &Value,
    from: &json_patch::jsonptr::Pointer,
    index: usize,
) -> Result<Measure, PatchFailure> {
    from.resolve(doc).map(measure).map_err(|_| {
        PatchFailure::Invalid(format!(
            "operation {index} failed at path '{from}': \"from\" path is invalid"
        ))
    })
}

fn operation_name(operation: &PatchOperation) -> &'static str {
    match operation {
        PatchOperation::Add(_) => "add",
        PatchOperation::Remove(_) => "remove",
        PatchOperation::Replace(_) => "replace",
        PatchOperation::Move(_) => "move",
        PatchOperation::Copy(_) => "copy",
        PatchOperation::Test(_) => "test",
    }
}

#[cfg(test)]
mod tests;
