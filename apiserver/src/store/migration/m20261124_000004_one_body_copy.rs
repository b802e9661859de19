//! One copy of each body: change-log entries of current versions stop repeating the body.
//!
//! From this version on the change-log entry of an object's current version reads its body from
//! the `objects` row (see `store::write`); before, every entry held a full copy, so a store
//! whose change log still covered every object (the default keeps 100,000 entries) held each
//! body twice. This migration empties the bodies that an `objects` row holds at the same
//! version, which is what new writes leave behind. `down` puts them back, for a downgrade.
//!
//! A binary older than this migration refuses to start on a migrated database (sea-orm-migration
//! reports the applied migration it does not know), rather than serve watch events with empty
//! bodies; docs/sql-schema.md "Downgrading" says how to go back.

use sea_orm_migration::prelude::*;

use crate::store::change_log::{BODY_IN_OBJECTS, object_row_of_change};
use crate::store::schema::{Changes, Objects};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261124_000004_one_body_copy"
    }
}

/// The `objects` row holding version `changes.rv` of the entry's object.
fn current_row() -> SelectStatement {
    Query::select()
        .expr(Expr::val(1))
        .from(Objects::Table)
        .cond_where(object_row_of_change())
        .to_owned()
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .exec_stmt(
                Query::update()
                    .table(Changes::Table)
                    .value(Changes::Body, BODY_IN_OBJECTS)
                    .and_where(Expr::exists(current_row()))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let mut body = current_row();
        body.clear_selects();
        body.column((Objects::Table, Objects::Body));
        manager
            .exec_stmt(
                Query::update()
                    .table(Changes::Table)
                    .value(Changes::Body, Expr::SubQuery(None, Box::new(body.into())))
                    .and_where(Expr::col(Changes::Body).eq(BODY_IN_OBJECTS))
                    .to_owned(),
            )
            .await
    }
}
