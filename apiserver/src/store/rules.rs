//! The `policy_rules` dictionary: what every result of one policy rule shares (source, policy,
//! rule, category, severity, scored), stored once and referenced by id from each `results`
//! row.
//!
//! A round of writes resolves the rules of all its results at once ([`Store::resolve_rules`]):
//! rules this process has seen committed come from memory; the others are read, and those not
//! found are inserted, in the round's transaction. Every write transaction holds the
//! resourceVersion counter's row lock, so two writers (in this process or another replica)
//! never insert the same rule at once, and the table needs no unique key over six nullable
//! columns (which MySQL could not index at these lengths anyway). Ids enter the process-wide
//! cache only once committed, so a rolled-back round leaves no dangling id behind. Rows are
//! never deleted: the table grows with the number of distinct rules, not of results.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend};

use super::columns::{ResultRow, RuleKey};
use super::schema::PolicyRules;
use super::{Store, StoreError};

/// Rules remembered per process; past this the cache starts over (a scanner such as Trivy
/// names each vulnerability as a policy, so the set is open-ended).
const CACHED_RULES: usize = 100_000;

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
    /// The id of the rule of each row, in order.
    pub(super) fn ids_of(&self, rows: &[ResultRow]) -> Result<Vec<i64>, StoreError> {
        rows.iter()
            .map(|r| {
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
                let key = RuleKey {
                    source: row.try_get("", "source")?,
                    policy: row.try_get("", "policy")?,
                    rule: row.try_get("", "rule")?,
                    category: row.try_get("", "category")?,
                    severity: row.try_get("", "severity")?,
                    scored: row.try_get("", "scored")?,
                };
                if missing.contains(&key) && !round.ids.contains_key(&key) {
                    let id: i64 = row.try_get("", "id")?;
                    round.ids.insert(key.clone(), id);
                    round.new.push((key, id));
                }
            }
        }
        for key in missing {
            if round.ids.contains_key(&key) {
                continue;
            }
            let id = self.insert_rule(txn, &key).await?;
            round.ids.insert(key.clone(), id);
            round.new.push((key, id));
        }
        Ok(round)
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
            .values_panic([
                key.source.clone().into(),
                key.policy.clone().into(),
                key.rule.clone().into(),
                key.category.clone().into(),
                key.severity.clone().into(),
                key.scored.into(),
            ]);
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
