//! The reads of the in-process Kyverno merge (`crate::report_merge`): which namespaces hold
//! merge inputs, one page of a namespace's inputs cut by subject, and the ephemeral reports
//! that name no owner yet.
//!
//! Why the store answers these and not [`Store::list`]: a merge page is a set of *subjects*
//! (resource UIDs), not a range of names. Ephemeral reports written by Kyverno's admission
//! webhook have random names and name their subject only by a label
//! (`audit.kyverno.io/resource.uid`) or their first ownerReference; per-resource policy reports
//! carry it in `scope.uid`. So a page first selects the next subject UIDs from the indexed
//! `scope_uid`, `object_labels` and `owner_uids` columns (keyset paging on the subject, in the
//! database's order for the column, so the cut and the comparison agree) and then loads the
//! bodies of exactly those subjects, all in one read snapshot. Nothing namespace-wide is held in
//! memory. What the rows mean (which report a page keeps) is the merger's business.

use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{
    Alias, Cond, Expr, ExprTrait, Iden, JoinType, Order, Query, SelectStatement, SimpleExpr,
    UnionType,
};
use sea_orm::{ConnectionTrait, DbBackend, StatementBuilder};
use serde_json::Value;

use super::schema::{ObjectLabels, Objects};
use super::{Store, StoreError, parse_document};

/// The labels by which the merge recognises its inputs.
#[derive(Clone, Copy, Debug)]
pub struct MergeLabels<'a> {
    /// The label naming an ephemeral report's subject UID (before its ownerReference).
    pub subject: &'a str,
    /// `key = value` on the policy reports the merge writes (and so may rewrite).
    pub managed_by: (&'a str, &'a str),
}

/// One page of a namespace's merge inputs.
#[derive(Clone, Copy, Debug)]
pub struct MergePageQuery<'a> {
    pub namespace: &'a str,
    /// The final kind the merge writes (PolicyReport, Report, …).
    pub reports: &'static ResourceDescriptor,
    /// Other final kinds whose *managed* reports the merge takes over (the other report
    /// group's, after a switch of the output group); their other reports are never read.
    pub taken_over: &'a [&'static ResourceDescriptor],
    /// The kind it reads (EphemeralReport or ClusterEphemeralReport).
    pub ephemerals: &'static ResourceDescriptor,
    /// The last subject of the previous page (`None` on the first page).
    pub after: Option<&'a str>,
    pub limit: usize,
    pub labels: MergeLabels<'a>,
}

impl MergePageQuery<'_> {
    /// The written kind and the taken-over ones.
    fn final_kinds(&self) -> Vec<&'static ResourceDescriptor> {
        std::iter::once(self.reports)
            .chain(self.taken_over.iter().copied())
            .collect()
    }
}

/// What a page's subjects have stored.
#[derive(Debug, Default)]
pub struct MergePage {
    /// The page's subjects, in order.
    pub subjects: Vec<String>,
    /// The subject after which the next page starts, if one follows.
    pub next: Option<String>,
    /// Reports of the read kinds scoped to a subject of the page or named like one, and on
    /// the first page every report without a scope (per-policy reports span subjects).
    pub reports: Vec<Value>,
    /// Every ephemeral report of the page's subjects.
    pub ephemerals: Vec<Value>,
}

/// Table aliases of the hand-joined queries below.
fn o() -> Alias {
    Alias::new("o")
}
fn l() -> Alias {
    Alias::new("l")
}

impl Store {
    /// The namespaces (`""` = cluster scope) holding a report of `ephemerals`, and with
    /// `reports` also those holding a report of `reports` labelled as the merge's.
    pub async fn merge_namespaces(
        &self,
        ephemerals: &[&ResourceDescriptor],
        reports: Option<(&[&ResourceDescriptor], MergeLabels<'_>)>,
    ) -> Result<Vec<String>, StoreError> {
        let keys = |kinds: &[&ResourceDescriptor]| -> Vec<String> {
            kinds.iter().map(|r| Store::resource_key(r)).collect()
        };
        if ephemerals.is_empty() && reports.is_none() {
            return Ok(Vec::new());
        }
        let mut wanted = Cond::any();
        if !ephemerals.is_empty() {
            wanted = wanted.add(Expr::col((o(), Objects::Resource)).is_in(keys(ephemerals)));
        }
        if let Some((reports, labels)) = reports {
            wanted = wanted.add(
                Cond::all()
                    .add(Expr::col((o(), Objects::Resource)).is_in(keys(reports)))
                    .add(managed(labels)),
            );
        }
        let mut q = Query::select();
        q.distinct()
            .column((o(), Objects::Namespace))
            .from_as(Objects::Table, o())
            .and_where(Expr::col((o(), Objects::ClusterId)).eq(self.cluster_id()))
            .cond_where(wanted);
        let rows = self
            .unless_outage(async { Ok(self.connection().query_all(&q).await?) })
            .await?;
        rows.iter()
            .map(|r| Ok(r.try_get::<String>("", &Iden::to_string(&Objects::Namespace))?))
            .collect()
    }

    /// One page of merge inputs, from one read snapshot; abandoned when an outage begins
    /// meanwhile ([`Store::unless_outage`]).
    pub async fn merge_page(&self, q: &MergePageQuery<'_>) -> Result<MergePage, StoreError> {
        self.unless_outage(self.read_merge_page(q)).await
    }

    async fn read_merge_page(&self, q: &MergePageQuery<'_>) -> Result<MergePage, StoreError> {
        let txn = self.read_snapshot().await?;
        let limit = q.limit.max(1);
        let mut subjects: Vec<String> = txn
            .query_all(&self.subjects_statement(q, limit + 1))
            .await?
            .iter()
            .map(|r| r.try_get::<String>("", "subject"))
            .collect::<Result<_, _>>()?;
        let next = if subjects.len() > limit {
            subjects.truncate(limit);
            subjects.last().cloned()
        } else {
            None
        };
        let first_page = q.after.is_none();
        let mut page = MergePage {
            next,
            ..MergePage::default()
        };
        if !subjects.is_empty() || first_page {
            let statement = self.reports_statement(q, &subjects, first_page);
            page.reports = self
                .documents(&txn, &statement, q.namespace, q.reports)
                .await?;
        }
        if !subjects.is_empty() {
            let statement = self.ephemerals_statement(q, &subjects);
            page.ephemerals = self
                .documents(&txn, &statement, q.namespace, q.ephemerals)
                .await?;
        }
        txn.commit().await?;
        page.subjects = subjects;
        Ok(page)
    }

    /// The `metadata` of every report of `resource` in `namespace` without an ownerReference,
    /// in name order.
    pub async fn unowned_metadata(
        &self,
        resource: &ResourceDescriptor,
        namespace: &str,
    ) -> Result<Vec<Value>, StoreError> {
        let owners = Expr::col((o(), Objects::OwnerUids));
        let mut q = self.objects_of(resource, namespace);
        q.column((o(), Objects::Metadata))
            .cond_where(Cond::any().add(owners.clone().is_null()).add(owners.eq("")))
            .order_by((o(), Objects::Name), Order::Asc);
        let what = || format!("{namespace}/{}", Store::resource_key(resource));
        let column = Iden::to_string(&Objects::Metadata);
        let mut out = Vec::new();
        for row in self.connection().query_all(&q).await? {
            let text: String = row.try_get("", &column)?;
            out.push(parse_document(&what(), &text)?);
        }
        Ok(out)
    }

    /// `SELECT … FROM objects o WHERE` this cluster, `resource` and `namespace`.
    fn objects_of(&self, resource: &ResourceDescriptor, namespace: &str) -> SelectStatement {
        self.objects_of_any(&[resource], namespace)
    }

    /// `SELECT … FROM objects o WHERE` this cluster, one of `resources` and `namespace`.
    fn objects_of_any(
        &self,
        resources: &[&ResourceDescriptor],
        namespace: &str,
    ) -> SelectStatement {
        let keys: Vec<String> = resources.iter().map(|r| Store::resource_key(r)).collect();
        let mut q = Query::select();
        q.from_as(Objects::Table, o())
            .and_where(Expr::col((o(), Objects::ClusterId)).eq(self.cluster_id()))
            .and_where(Expr::col((o(), Objects::Resource)).is_in(keys))
            .and_where(Expr::col((o(), Objects::Namespace)).eq(namespace));
        q
    }

    /// `objects_of(ephemerals)` left-joined with each report's subject label row.
    fn ephemerals_of(&self, q: &MergePageQuery<'_>) -> SelectStatement {
        let mut s = self.objects_of(q.ephemerals, q.namespace);
        s.join_as(
            JoinType::LeftJoin,
            ObjectLabels::Table,
            l(),
            Cond::all()
                .add(Expr::col((l(), ObjectLabels::ObjectId)).equals((o(), Objects::Id)))
                .add(Expr::col((l(), ObjectLabels::Key)).eq(q.labels.subject)),
        );
        s
    }

    /// The next `limit` subjects after `q.after`: subjects of ephemeral reports and of managed
    /// reports with a `scope.uid`. `> ''` also drops rows without a subject.
    fn subjects_statement(&self, q: &MergePageQuery<'_>, limit: usize) -> SelectStatement {
        let subject = Alias::new("subject");
        let mut of_ephemerals = self.ephemerals_of(q);
        of_ephemerals.expr_as(ephemeral_subject(self.backend()), subject.clone());
        let mut of_reports = self.objects_of_any(&q.final_kinds(), q.namespace);
        of_reports
            .expr_as(Expr::col((o(), Objects::ScopeUid)), subject.clone())
            .and_where(managed(q.labels));
        of_ephemerals.union(UnionType::Distinct, of_reports);
        let s = Alias::new("s");
        let mut outer = Query::select();
        outer
            .column((s.clone(), subject.clone()))
            .from_subquery(of_ephemerals, s.clone())
            .and_where(Expr::col((s.clone(), subject.clone())).gt(q.after.unwrap_or("")))
            .order_by((s, subject), Order::Asc)
            .limit(limit as u64);
        outer
    }

    /// Reports of the read kinds scoped to a subject of the page, unmanaged ones named like
    /// one (name collisions), and on the first page every report without a scope.
    fn reports_statement(
        &self,
        q: &MergePageQuery<'_>,
        subjects: &[String],
        first_page: bool,
    ) -> SelectStatement {
        let scope = Expr::col((o(), Objects::ScopeUid));
        let mut wanted = Cond::any();
        if !subjects.is_empty() {
            wanted = wanted
                .add(scope.clone().is_in(subjects.iter().cloned()))
                .add(Expr::col((o(), Objects::Name)).is_in(subjects.iter().cloned()));
        }
        if first_page {
            wanted = wanted.add(scope.clone().is_null()).add(scope.eq(""));
        }
        // Of the taken-over kinds only the merge's own reports: another producer's report there
        // can neither collide with a written name nor be taken over.
        let kind = Cond::any()
            .add(Expr::col((o(), Objects::Resource)).eq(Store::resource_key(q.reports)))
            .add(managed(q.labels));
        let mut s = self.objects_of_any(&q.final_kinds(), q.namespace);
        s.column((o(), Objects::Body))
            .cond_where(wanted)
            .cond_where(kind)
            .order_by((o(), Objects::Name), Order::Asc);
        s
    }

    /// Every ephemeral report whose subject is one of `subjects`.
    fn ephemerals_statement(&self, q: &MergePageQuery<'_>, subjects: &[String]) -> SelectStatement {
        let mut s = self.ephemerals_of(q);
        s.column((o(), Objects::Body))
            .and_where(ephemeral_subject(self.backend()).is_in(subjects.iter().cloned()))
            .order_by((o(), Objects::Name), Order::Asc);
        s
    }

    /// The parsed `body` of every row `statement` selects.
    async fn documents(
        &self,
        txn: &impl ConnectionTrait,
        statement: &impl StatementBuilder,
        namespace: &str,
        resource: &ResourceDescriptor,
    ) -> Result<Vec<Value>, StoreError> {
        let what = || format!("{namespace}/{}", Store::resource_key(resource));
        let mut out = Vec::new();
        for row in txn.query_all(statement).await? {
            let body = self.body_of_row(&row, what)?;
            out.push(parse_document(&what(), &body)?);
        }
        Ok(out)
    }
}

/// `EXISTS` a label row `key = value` on the object `o`.
fn managed(labels: MergeLabels<'_>) -> SimpleExpr {
    let m = Alias::new("m");
    let (key, value) = labels.managed_by;
    Expr::exists(
        Query::select()
            .expr(Expr::val(1))
            .from_as(ObjectLabels::Table, m.clone())
            .and_where(Expr::col((m.clone(), ObjectLabels::ObjectId)).equals((o(), Objects::Id)))
            .and_where(Expr::col((m.clone(), ObjectLabels::Key)).eq(key))
            .and_where(Expr::col((m, ObjectLabels::Value)).eq(value))
            .to_owned(),
    )
}

/// The subject UID of an ephemeral report row `o` left-joined with its subject label row `l`:
/// the label, else the first ownerReference UID (`owner_uids` is the comma-joined list),
/// exactly as the aggregator's `Ephemeral::subject_uid` decides.
fn ephemeral_subject(backend: DbBackend) -> SimpleExpr {
    let owners = format!("o.{}", Iden::to_string(&Objects::OwnerUids));
    let first_owner = match backend {
        DbBackend::Postgres => format!("split_part({owners}, ',', 1)"),
        DbBackend::MySql => format!("SUBSTRING_INDEX({owners}, ',', 1)"),
        _ => format!(
            "CASE WHEN instr({owners}, ',') > 0 \
             THEN substr({owners}, 1, instr({owners}, ',') - 1) ELSE {owners} END"
        ),
    };
    let label = format!("l.{}", Iden::to_string(&ObjectLabels::Value));
    Expr::cust(format!(
        "COALESCE(NULLIF({label}, ''), NULLIF({first_owner}, ''))"
    ))
}
