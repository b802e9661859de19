//! The `policy_rules` dictionary: what every result of one policy rule shares (source, policy,
//! rule, category, severity, scored), stored once and referenced by id from each `results`
//! row.
//!
//! A round of writes resolves the rules of all its results at once ([`Store::resolve_rules`]):
//! rules this process has seen committed come from memory; the others are read, and those not
//! found are inserted, in the round's transaction (writers look their rules up in memory
//! before their round, so the round itself only looks for rules it has not seen). Every write
//! transaction holds the resourceVersion counter's row lock, so two writers (in this process
//! or another replica) never insert the same rule at once, and the table needs no unique key over six nullable
//! columns (which MySQL could not index at these lengths anyway). Ids enter the process-wide
//! cache only once committed, so a rolled-back round leaves no dangling id behind. Rows are
//! never deleted: the table grows with the number of distinct rules, not of results.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use sea_orm::sea_query::{Expr, ExprTrait, Query, SimpleExpr};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, QueryResult};

use super::columns::{ResultRow, RuleKey};
use super::schema::PolicyRules;
use super::{Store, StoreError};

/// Rules remembered per process; past this the cache starts over (a scanner such as Trivy
/// names each vulnerability as a policy, so the set is open-ended).
const CACHED_RULES: usize = 100_000;

/// Rules per INSERT: 3,000 bind parameters, far below every backend's limit.
const RULES_PER_INSERT: usize = 500;

/// Policies per SELECT of `policy_rules`.
const POLICIES_PER_READ: usize = 500;

/// The columns of a [`RuleKey`], in its field order.
const RULE_COLUMNS: [PolicyRules; 6] = [
    PolicyRules::Source,
    PolicyRules::Policy,
    PolicyRules::Rule,
    PolicyRules::Category,
    PolicyRules::Severity,
    PolicyRules::Scored,
];

/// Ids of the rules this process has seen committed.
#[derive(Default)]
pub(super) struct RuleCache(Mutex<HashMap<RuleKey, i64>>);

/// The rule ids a round's result rows use.
#[derive(Default)]
pub(super) struct RoundRules {
    ids: HashMap<RuleKey, i64>,
    /// Read or inserted in this round: cached once the round commits.
    new: Vec<(RuleKey, i64)>,
}

impl RoundRules {
    /// The id of the rule of each row, in order: `known[i]` when the writer found it, else
    /// resolved by the round.
    pub(super) fn ids_of(
        &self,
        rows: &[ResultRow],
        known: &[Option<i64>],
    ) -> Result<Vec<i64>, StoreError> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| {
                if let Some(id) = known.get(i).copied().flatten() {
                    return Ok(id);
                }
                self.ids.get(&r.rule).copied().ok_or_else(|| {
                    StoreError::Inconsistent(format!(
                        "policy rule {:?} was not resolved before its results were written",
                        r.rule
                    ))
                })
            })
            .collect()
    }
}

impl RuleCache {
    /// The committed id of each row's rule, where this process knows it: a writer looks them
    /// up before its round, which then resolves only the others.
    pub(super) fn known_ids(&self, rows: &[ResultRow]) -> Vec<Option<i64>> {
        let cache = self.0.lock().expect("rule cache lock");
        rows.iter().map(|r| cache.get(&r.rule).copied()).collect()
    }

    /// Remembers the rules a committed round resolved.
    pub(super) fn remember(&self, round: RoundRules) {
        if round.new.is_empty() {
            return;
        }
        let mut cache = self.0.lock().expect("rule cache lock");
        if cache.len() + round.new.len() > CACHED_RULES {
            cache.clear();
        }
        cache.extend(round.new);
    }
}

impl Store {
    /// The ids of `keys` for a round's result rows, inserting the rules never seen before.
    pub(super) async fn resolve_rules(
        &self,
        txn: &DatabaseTransaction,
        keys: HashSet<RuleKey>,
    ) -> Result<RoundRules, StoreError> {
        let mut round = RoundRules::default();
        let mut missing = HashSet::new();
        {
            let cache = self.rule_cache.0.lock().expect("rule cache lock");
            for key in keys {
                match cache.get(&key) {
                    Some(id) => {
                        round.ids.insert(key, *id);
                    }
                    None => {
                        missing.insert(key);
                    }
                }
            }
        }
        if missing.is_empty() {
            return Ok(round);
        }
        let mut policies: Vec<&str> = missing.iter().map(|k| k.policy.as_str()).collect();
        policies.sort_unstable();
        policies.dedup();
        for chunk in policies.chunks(POLICIES_PER_READ) {
            let select = Query::select()
                .column(PolicyRules::Id)
                .columns(RULE_COLUMNS)
                .from(PolicyRules::Table)
                .and_where(Expr::col(PolicyRules::Policy).is_in(chunk.iter().copied()))
                .to_owned();
            for row in txn.query_all(&select).await? {
                let key = rule_key_of(&row)?;
                if missing.contains(&key) && !round.ids.contains_key(&key) {
                    let id: i64 = row.try_get("", "id")?;
                    round.ids.insert(key.clone(), id);
                    round.new.push((key, id));
                }
            }
        }
        let unknown: Vec<RuleKey> = missing
            .into_iter()
            .filter(|key| !round.ids.contains_key(key))
            .collect();
        for (key, id) in self.insert_rules(txn, unknown).await? {
            round.ids.insert(key.clone(), id);
            round.new.push((key, id));
        }
        Ok(round)
    }

    /// Inserts `keys`, returning each with its id: many rows per statement where the backend
    /// returns their ids (a report of 12,000 new rules took 130 ms one row at a time).
    async fn insert_rules(
        &self,
        txn: &DatabaseTransaction,
        keys: Vec<RuleKey>,
    ) -> Result<Vec<(RuleKey, i64)>, StoreError> {
        let mut inserted = Vec::with_capacity(keys.len());
        if self.backend() == DbBackend::MySql {
            for key in keys {
                let id = self.insert_rule(txn, &key).await?;
                inserted.push((key, id));
            }
            return Ok(inserted);
        }
        for chunk in keys.chunks(RULES_PER_INSERT) {
            let mut insert = Query::insert();
            insert.into_table(PolicyRules::Table).columns(RULE_COLUMNS);
            for key in chunk {
                insert.values_panic(rule_values(key));
            }
            insert.returning(
                Query::returning().columns(std::iter::once(PolicyRules::Id).chain(RULE_COLUMNS)),
            );
            let wanted: HashSet<&RuleKey> = chunk.iter().collect();
            for row in txn.query_all(&insert).await? {
                let key = rule_key_of(&row)?;
                if !wanted.contains(&key) {
                    return Err(StoreError::Inconsistent(format!(
                        "INSERT INTO policy_rules returned the rule {key:?}, which it was not given"
                    )));
                }
                inserted.push((key, row.try_get("", "id")?));
            }
        }
        if inserted.len() != keys.len() {
            return Err(StoreError::Inconsistent(format!(
                "INSERT INTO policy_rules returned {} ids for {} rules",
                inserted.len(),
                keys.len()
            )));
        }
        Ok(inserted)
    }

    async fn insert_rule(
        &self,
        txn: &DatabaseTransaction,
        key: &RuleKey,
    ) -> Result<i64, StoreError> {
        let mut insert = Query::insert();
        insert
            .into_table(PolicyRules::Table)
            .columns(RULE_COLUMNS)
            .values_panic(rule_values(key));
        if self.backend() == DbBackend::MySql {
            let res = txn.execute(&insert).await?;
            return Ok(res.last_insert_id() as i64);
        }
        insert.returning_col(PolicyRules::Id);
        let row = txn.query_one(&insert).await?.ok_or_else(|| {
            StoreError::Inconsistent("INSERT INTO policy_rules … RETURNING returned no row".into())
        })?;
        Ok(row.try_get("", "id")?)
    }
}

/// The values of a rule's row, in [`RULE_COLUMNS`] order.
fn rule_values(key: &RuleKey) -> [SimpleExpr; 6] {
    [
        key.source.clone().into(),
        key.policy.clone().into(),
        key.rule.clone().into(),
        key.category.clone().into(),
        key.severity.clone().into(),
        key.scored.into(),
    ]
}

fn rule_key_of(row: &QueryResult) -> Result<RuleKey, StoreError> {
    Ok(RuleKey {
        source: row.try_get("", "source")?,
        policy: row.try_get("", "policy")?,
        rule: row.try_get("", "rule")?,
        category: row.try_get("", "category")?,
        severity: row.try_get("", "severity")?,
        scored: row.try_get("", "scored")?,
    })
}
