//! One copy of each body: the change-log entry of an object's current version does not repeat
//! the body the `objects` row holds (its `body` is [`BODY_IN_OBJECTS`], and the feed reads it
//! through a join, [`object_row_of_change`]). The write that supersedes that version moves the
//! old body into the entry, in the same transaction, so a watch resuming from an older
//! resourceVersion still gets each version as it was. Only versions inside the retention window
//! are ever stored twice over.

use sea_orm::sea_query::{Condition, Expr, ExprTrait};

use super::schema::{Changes, Objects};

/// The change-log `body` of an entry whose body is the `objects` row's (see the module docs).
/// No JSON document is empty, so it cannot be mistaken for one.
pub(super) const BODY_IN_OBJECTS: &str = "";

/// The `objects` row holding the version a `changes` entry is about: where an entry whose body
/// is [`BODY_IN_OBJECTS`] finds it (the feed's join, the one-body-copy migration).
pub(super) fn object_row_of_change() -> Condition {
    let same = |o: Objects, c: Changes| Expr::col((Objects::Table, o)).equals((Changes::Table, c));
    Condition::all()
        .add(same(Objects::ClusterId, Changes::ClusterId))
        .add(same(Objects::Resource, Changes::Resource))
        .add(same(Objects::Namespace, Changes::Namespace))
        .add(same(Objects::Name, Changes::Name))
        .add(same(Objects::ResourceVersion, Changes::Rv))
}
