//! Fuzzing that stays: every decoder of client input, run on generated and mutated inputs with
//! a time and a memory bound per input. CI runs a small budget; a longer run is one variable:
//!
//! ```sh
//! REPORTS_SERVER_FUZZ_CASES=100000 cargo test --release -p reports-server-apiserver --test fuzz
//! ```
//!
//! Memory is measured by this binary's own allocator (peak bytes live during one input, over
//! what was live before it), so the harnesses run one after another in a single test: a second
//! test thread would count into the same figures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reports_server_apiserver::continuation::ContinueToken;
use reports_server_apiserver::fieldmanager::{
    ManagedFields, manager_from_user_agent, validate_manager,
};
use reports_server_apiserver::http::negotiate::{Target, negotiate};
use reports_server_apiserver::http::request::{Params, decode_body};
use reports_server_apiserver::registry::fields::{parse_noting_duplicates, parse_yaml};
use reports_server_apiserver::registry::patch::{
    ObjectLimits, apply_json_patch, apply_merge_patch,
};
use reports_server_apiserver::registry::{FieldValidation, ResourceRef, Validation, decide_apply};
use reports_server_apiserver::selector::{FieldSelector, LabelSelector};
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use serde_json::{Value, json};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Time one input may take (debug build, shared 2-core machine) and memory it may hold beyond
/// a small multiple of its size.
const TIME_BOUND: Duration = Duration::from_secs(2);
const MEMORY_SLACK: usize = 16 << 20;

fn cases() -> u32 {
    std::env::var("REPORTS_SERVER_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(256)
}

/// Runs `target` on one input of `size` bytes and checks its time and peak memory.
fn bounded<T>(name: &str, size: usize, target: impl FnOnce() -> T) -> Result<(), TestCaseError> {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let started = Instant::now();
    let result = target();
    let took = started.elapsed();
    drop(result);
    let grew = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    prop_assert!(
        took <= TIME_BOUND,
        "{name}: {took:?} for {size} bytes of input"
    );
    let bound = 64 * size + MEMORY_SLACK;
    prop_assert!(
        grew <= bound,
        "{name}: {grew} bytes held for {size} bytes of input (bound {bound})"
    );
    Ok(())
}

fn run<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let started = Instant::now();
    runner
        .run(&strategy, test)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    eprintln!(
        "[fuzz] {name}: {} inputs in {:?}",
        cases(),
        started.elapsed()
    );
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|n| json!(n)),
        ".{0,16}".prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    "[a-z]{1,6}",
                    Just("metadata".to_owned()),
                    Just("results".to_owned()),
                    Just("f:spec".to_owned())
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Bytes that are mostly JSON or YAML: valid documents, with bytes flipped, cut or repeated.
fn body_bytes() -> impl Strategy<Value = Vec<u8>> {
    let document = || json_value().prop_map(|v| serde_json::to_vec(&v).unwrap());
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        document(),
        (document(), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(mut d, at, b)| {
            if !d.is_empty() {
                let i = at.index(d.len());
                d[i] = b;
            }
            d
        }),
        (document(), 1usize..50).prop_map(|(d, n)| {
            // Deep or repeated: `[[[[…` and `{"a":1,"a":1,…`.
            let mut out = b"[".repeat(n * 3);
            out.extend_from_slice(&d);
            out
        }),
        ("[a-z]{1,4}", 1usize..200).prop_map(|(k, n)| format!(
            "a: &x {k}\nb: [{}]\n",
            vec!["*x"; n].join(",")
        )
        .into_bytes()),
    ]
}

fn report() -> Value {
    let mut report = serde_json::to_value(pss_policy_report(
        &Subject::pod("ns", 1),
        1_700_000_000,
        &[1],
    ))
    .unwrap();
    report["metadata"]["name"] = json!("r");
    report
}

fn pointer() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just("metadata".to_owned()),
            Just("results".to_owned()),
            Just("0".to_owned()),
            Just("-".to_owned()),
            "[a-z~01/]{1,4}"
        ],
        0..5,
    )
    .prop_map(|tokens| tokens.iter().map(|t| format!("/{t}")).collect())
}

fn patch_operation() -> impl Strategy<Value = Value> {
    let op = prop::sample::select(vec![
        "add", "remove", "replace", "move", "copy", "test", "bogus",
    ]);
    (op, pointer(), pointer(), json_value()).prop_map(
        |(op, path, from, value)| json!({"op": op, "path": path, "from": from, "value": value}),
    )
}

#[test]
fn every_decoder_of_client_input_is_bounded_and_never_panics() {
    run(
        "request bodies",
        (
            body_bytes(),
            prop::sample::select(vec!["application/json", "application/yaml", "text/plain"]),
        ),
        |(body, content_type)| {
            bounded("decode_body", body.len(), || {
                decode_body(Some(content_type), &body)
            })?;
            bounded("parse_noting_duplicates", body.len(), || {
                parse_noting_duplicates(&body)
            })?;
            bounded("parse_yaml", body.len(), || parse_yaml(&body))
        },
    );
    let key = prop::sample::select(vec![
        "labelSelector",
        "fieldSelector",
        "limit",
        "continue",
        "resourceVersion",
        "resourceVersionMatch",
        "timeoutSeconds",
        "watch",
        "dryRun",
        "fieldManager",
        "fieldValidation",
        "sendInitialEvents",
        "x",
    ]);
    run(
        "query parameters",
        prop::collection::hash_map(key, ".{0,40}", 0..6),
        |query| {
            let query: HashMap<String, String> =
                query.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let size = query.values().map(String::len).sum();
            bounded("Params::parse", size, || Params::parse(&query))
        },
    );
    run(
        "selectors",
        "[a-z0-9=!(),. /_-]{0,120}|(in|notin|metadata\\.name|[a-z]| |,|\\(|\\)|=|!){0,60}",
        |text| {
            bounded("LabelSelector::parse", text.len(), || {
                LabelSelector::parse(&text)
            })?;
            bounded("FieldSelector::parse", text.len(), || {
                FieldSelector::parse(&text)
            })
        },
    );
    run("continue tokens and Accept headers", ".{0,200}", |text| {
        bounded("ContinueToken::decode", text.len(), || {
            ContinueToken::decode(&text, "q")
        })?;
        bounded("negotiate", text.len(), || {
            negotiate(Some(&text), Target::Collection)
                .map(|_| ())
                .map_err(|_| ())
        })?;
        bounded("validate_manager", text.len(), || validate_manager(&text))?;
        bounded("manager_from_user_agent", text.len(), || {
            manager_from_user_agent(Some(&text))
        })
    });
    run(
        "JSON patches",
        prop::collection::vec(patch_operation(), 0..24),
        |ops| {
            let size = serde_json::to_vec(&ops).unwrap().len();
            let Ok(patch) = serde_json::from_value::<json_patch::Patch>(Value::Array(ops)) else {
                return Ok(());
            };
            bounded("apply_json_patch", size, || {
                let mut doc = report();
                apply_json_patch(&mut doc, &patch.0, &ObjectLimits::default())
            })
        },
    );
    run(
        "merge patches, applies and managedFields",
        json_value(),
        |value| {
            let size = serde_json::to_vec(&value).unwrap().len();
            bounded("apply_merge_patch", size, || {
                let mut doc = report();
                apply_merge_patch(&mut doc, &value, &ObjectLimits::default())
            })?;
            bounded("ManagedFields::decode", size, || {
                ManagedFields::decode(Some(&value))
            })?;
            let path = ResourceRef::new(&POLICY_REPORT, "ns");
            let validation = Validation::new(FieldValidation::Warn, Vec::new());
            bounded("decide_apply", size, || {
                decide_apply(
                    &path,
                    "r",
                    Some(report()),
                    value.clone(),
                    &validation,
                    "fuzz",
                    false,
                )
                .map(|_| ())
            })
        },
    );
}
