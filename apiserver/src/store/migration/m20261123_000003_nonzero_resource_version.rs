//! The resourceVersion counter never reads 0.
//!
//! An empty database used to answer lists with `metadata.resourceVersion: "0"`. client-go gives
//! `"0"` (and `""`) a meaning of their own — "any version" for lists and watches — and its
//! `RetryWatcher` refuses to start from either, so every Kyverno controller looped on
//! `initial RV "0" is not supported` and a fresh installation never got its first report.
//! kube-apiserver never returns these values. New counter rows start at 1
//! (`Store::ensure_state_row`); this migration lifts rows created before that, which only
//! differ if nothing was ever written for their `cluster_id`.

use sea_orm_migration::prelude::*;

use crate::store::schema::StoreState;

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261123_000003_nonzero_resource_version"
    }
}

/// The first resourceVersion a store answers with (see the module docs).
pub const FIRST_RESOURCE_VERSION: i64 = 1;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .exec_stmt(
                Query::update()
                    .table(StoreState::Table)
                    .value(StoreState::Rv, FIRST_RESOURCE_VERSION)
                    .and_where(Expr::col(StoreState::Rv).lt(FIRST_RESOURCE_VERSION))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        // Lowering the counter could hand out a resourceVersion twice.
        Ok(())
    }
}
