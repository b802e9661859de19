//! Reads: get, list (label and field selectors and keyset pagination in SQL) and versions.

use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{Alias, Cond, Expr, ExprTrait, Order, Query, SelectStatement};
use sea_orm::{
    AccessMode, ConnectionTrait, DbBackend, IsolationLevel, QueryResult, Statement,
    TransactionTrait,
};
use serde_json::Value;

use super::body::BodyCodec;
use super::schema::{ObjectLabels, Objects, StoreState};
use super::{Store, StoreError, parse_document};
use crate::selector::{Field, FieldSelector, LabelSelector, Requirement};

/// One object as a list returns it: the body stays a string unless the caller needs it.
#[derive(Clone, Debug)]
pub struct ListRow {
    pub id: i64,
    pub namespace: String,
    pub name: String,
    pub resource_version: i64,
    /// `metadata` as JSON text.
    pub metadata: String,
    /// The whole object as JSON text; empty when the query asked for metadata only.
    pub body: String,
    pub summary: [i64; 5],
    pub scope_kind: Option<String>,
    pub scope_name: Option<String>,
}

/// A list request after parsing and validation.
#[derive(Clone, Debug)]
pub struct ListQuery {
    pub resource: &'static ResourceDescriptor,
    /// `None` lists across all namespaces.
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// Maximum number of rows; `None` for all.
    pub limit: Option<u64>,
    /// Return rows strictly after this (namespace, name).
    pub after: Option<(String, String)>,
    /// Skip the body column (metadata-only and table responses).
    pub metadata_only: bool,
}

impl ListQuery {
    /// Every object of `resource` in all namespaces, bodies included, in one page; narrow it
    /// with struct update syntax (`ListQuery { limit: Some(10), ..ListQuery::all(r) }`).
    pub fn all(resource: &'static ResourceDescriptor) -> Self {
        ListQuery {
            resource,
            namespace: None,
            labels: LabelSelector::default(),
            fields: FieldSelector::default(),
            limit: None,
            after: None,
            metadata_only: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ListPage {
    pub rows: Vec<ListRow>,
    /// The resourceVersion the page is consistent with.
    pub resource_version: i64,
    /// Whether more rows follow the last one.
    pub more: bool,
}

pub(super) async fn versions(
    db: &impl ConnectionTrait,
    backend: DbBackend,
    cluster_id: &str,
) -> Result<(i64, i64), StoreError> {
    let row = db
        .query_one(
            &Query::select()
                .columns([StoreState::Rv, StoreState::CompactedRv])
                .from(StoreState::Table)
                .and_where(Expr::col(StoreState::ClusterId).eq(cluster_id))
                .to_owned(),
        )
        .await?
        .ok_or_else(|| no_state_row(cluster_id, backend))?;
    Ok((row.try_get("", "rv")?, row.try_get("", "compacted_rv")?))
}

/// The resourceVersion counter's row is missing (`Store::connect` creates it).
pub(super) fn no_state_row(cluster_id: &str, backend: DbBackend) -> StoreError {
    StoreError::Inconsistent(format!(
        "store_state has no row for cluster {cluster_id} ({backend:?})"
    ))
}

const LIST_COLUMNS: [Objects; 10] = [
    Objects::Id,
    Objects::Namespace,
    Objects::Name,
    Objects::ResourceVersion,
    Objects::Metadata,
    Objects::SummaryPass,
    Objects::SummaryFail,
    Objects::SummaryWarn,
    Objects::SummaryError,
    Objects::SummarySkip,
];

/// A row of [`Store::select_objects`]; `bodies` decodes the body when it was selected.
fn row_of(row: &QueryResult, bodies: Option<BodyCodec>) -> Result<ListRow, StoreError> {
    let namespace: String = row.try_get("", "namespace")?;
    let name: String = row.try_get("", "name")?;
    let body = match bodies {
        Some(codec) => codec.decode_required(row, "body", || format!("{namespace}/{name}"))?,
        None => String::new(),
    };
    Ok(ListRow {
        id: row.try_get("", "id")?,
        namespace,
        name,
        resource_version: row.try_get("", "resource_version")?,
        metadata: row.try_get("", "metadata")?,
        body,
        summary: [
            row.try_get("", "summary_pass")?,
            row.try_get("", "summary_fail")?,
            row.try_get("", "summary_warn")?,
            row.try_get("", "summary_error")?,
            row.try_get("", "summary_skip")?,
        ],
        scope_kind: row.try_get("", "scope_kind")?,
        scope_name: row.try_get("", "scope_name")?,
    })
}

fn label_condition(req: &Requirement) -> Cond {
    let sub = |key: &str, values: Option<&[String]>| {
        let mut q = Query::select();
        q.expr(Expr::val(1))
            .from_as(ObjectLabels::Table, Alias::new("l"))
            .and_where(
                Expr::col((Alias::new("l"), ObjectLabels::ObjectId))
                    .equals((Objects::Table, Objects::Id)),
            )
            .and_where(Expr::col((Alias::new("l"), ObjectLabels::Key)).eq(key));
        if let Some(values) = values {
            q.and_where(
                Expr::col((Alias::new("l"), ObjectLabels::Value)).is_in(values.iter().cloned()),
            );
        }
        q.to_owned()
    };
    match req {
        Requirement::Exists(k) => Cond::all().add(Expr::exists(sub(k, None))),
        Requirement::NotExists(k) => Cond::all().add(Expr::exists(sub(k, None)).not()),
        Requirement::In(k, vs) => Cond::all().add(Expr::exists(sub(k, Some(vs)))),
        Requirement::NotIn(k, vs) => Cond::all().add(Expr::exists(sub(k, Some(vs))).not()),
    }
}

impl Store {
    fn select_objects(&self, desc: &ResourceDescriptor, with_body: bool) -> SelectStatement {
        let mut q = Query::select();
        q.columns(LIST_COLUMNS.map(|c| (Objects::Table, c)))
            .column((Objects::Table, Objects::ScopeKind))
            .column((Objects::Table, Objects::ScopeName))
            .from(Objects::Table)
            .and_where(Expr::col((Objects::Table, Objects::ClusterId)).eq(self.cluster_id()))
            .and_where(
                Expr::col((Objects::Table, Objects::Resource)).eq(Store::resource_key(desc)),
            );
        if with_body {
            q.column((Objects::Table, Objects::Body));
        }
        q
    }

    /// Reads one object.
    pub async fn get(
        &self,
        desc: &ResourceDescriptor,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ListRow>, StoreError> {
        let q = self
            .select_objects(desc, true)
            .and_where(Expr::col((Objects::Table, Objects::Namespace)).eq(namespace))
            .and_where(Expr::col((Objects::Table, Objects::Name)).eq(name))
            .to_owned();
        self.connection()
            .query_one(&q)
            .await?
            .map(|r| row_of(&r, Some(self.bodies())))
            .transpose()
    }

    /// Reads one object and decodes it.
    pub async fn get_object(
        &self,
        desc: &ResourceDescriptor,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, StoreError> {
        match self.get(desc, namespace, name).await? {
            Some(row) => Ok(Some(parse_document(
                &format!("{namespace}/{name}"),
                &row.body,
            )?)),
            None => Ok(None),
        }
    }

    fn list_statement(&self, query: &ListQuery) -> SelectStatement {
        let mut q = self.select_objects(query.resource, !query.metadata_only);
        let ns_col = Expr::col((Objects::Table, Objects::Namespace));
        let name_col = Expr::col((Objects::Table, Objects::Name));
        if let Some(ns) = &query.namespace {
            q.and_where(ns_col.clone().eq(ns.as_str()));
        }
        for req in &query.fields.0 {
            let col = match req.field {
                Field::Name => name_col.clone(),
                Field::Namespace => ns_col.clone(),
            };
            q.and_where(if req.equal {
                col.eq(req.value.as_str())
            } else {
                col.ne(req.value.as_str())
            });
        }
        for req in &query.labels.0 {
            q.cond_where(label_condition(req));
        }
        if let Some((ns, name)) = &query.after {
            q.cond_where(
                Cond::any().add(ns_col.clone().gt(ns.as_str())).add(
                    Cond::all()
                        .add(ns_col.clone().eq(ns.as_str()))
                        .add(name_col.clone().gt(name.as_str())),
                ),
            );
        }
        q.order_by((Objects::Table, Objects::Namespace), Order::Asc)
            .order_by((Objects::Table, Objects::Name), Order::Asc);
        if let Some(limit) = query.limit {
            q.limit(limit + 1);
        }
        q
    }

    /// Lists one page. The page and its resourceVersion come from one read snapshot.
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let txn = match self.backend() {
            DbBackend::Postgres | DbBackend::MySql => {
                self.connection()
                    .begin_with_config(
                        Some(IsolationLevel::RepeatableRead),
                        Some(AccessMode::ReadOnly),
                    )
                    .await?
            }
            _ => self.connection().begin().await?,
        };
        let (resource_version, _) = versions(&txn, self.backend(), self.cluster_id()).await?;
        let rows = txn.query_all(&self.list_statement(query)).await?;
        txn.commit().await?;
        let mut rows = rows
            .iter()
            .map(|r| row_of(r, (!query.metadata_only).then(|| self.bodies())))
            .collect::<Result<Vec<_>, _>>()?;
        let more = query.limit.is_some_and(|l| rows.len() as u64 > l);
        if more {
            rows.pop();
        }
        Ok(ListPage {
            rows,
            resource_version,
            more,
        })
    }

    /// Counts objects of a kind (all namespaces); for metrics and benchmarks.
    pub async fn count(&self, desc: &ResourceDescriptor) -> Result<i64, StoreError> {
        let q = Query::select()
            .expr_as(Expr::col(Objects::Id).count(), Alias::new("n"))
            .from(Objects::Table)
            .and_where(Expr::col(Objects::ClusterId).eq(self.cluster_id()))
            .and_where(Expr::col(Objects::Resource).eq(Store::resource_key(desc)))
            .to_owned();
        let row = self
            .connection()
            .query_one(&q)
            .await?
            .ok_or_else(|| StoreError::Inconsistent("COUNT returned nothing".into()))?;
        Ok(row.try_get("", "n")?)
    }

    /// Runs a raw statement; for tests and the analytics examples.
    pub async fn query_raw(&self, sql: &str) -> Result<Vec<QueryResult>, StoreError> {
        Ok(self
            .connection()
            .query_all_raw(Statement::from_string(self.backend(), sql))
            .await?)
    }
}
