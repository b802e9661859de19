//! `store_state.cluster_uid`: which cluster a `cluster_id` belongs to.
//!
//! Several clusters may share one database, each under its own `--cluster-id`. Two clusters
//! left at the default id `default` would read and overwrite each other's reports without a
//! word, so a server that knows its cluster (delegated mode: the `kube-system` namespace's UID)
//! records it on its id's counter row and refuses to start on an id recorded for another
//! cluster (`store::cluster_identity`). Rows written before stay `NULL` until a server of the
//! cluster starts on them.

use sea_orm_migration::prelude::*;

use super::add_column_unless_present;
use crate::store::schema::StoreState;

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000010_cluster_identity"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let mut uid = ColumnDef::new(StoreState::ClusterUid);
        uid.string_len(64).null();
        add_column_unless_present(manager, StoreState::Table, uid).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(StoreState::Table)
                    .drop_column(StoreState::ClusterUid)
                    .to_owned(),
            )
            .await
    }
}
