//! The decisions of a migration, free of I/O: what the copy in the database must change to equal
//! the source, whether the two agree, which resourceVersion floor makes etcd revisions harmless,
//! and the objects (write fence, APIService patch) the engine sends.

use std::collections::{BTreeMap, BTreeSet};

use reports_server_crds::ResourceDescriptor;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Where an object lives within its kind: namespace (`""` for cluster scope) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn of(object: &Value) -> Self {
        let text = |field: &str| object["metadata"][field].as_str().unwrap_or("").to_owned();
        ObjectKey {
            namespace: text("namespace"),
            name: text("name"),
        }
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            f.write_str(&self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

/// SHA-256 of an object's content: everything but `metadata.resourceVersion`, which each
/// storage assigns itself. Object keys are hashed in sorted order: kube-apiserver writes them
/// sorted, the server keeps them as they were sent, and the order carries no meaning.
pub fn content_hash(object: &Value) -> [u8; 32] {
    let mut copy = object.clone();
    if let Some(meta) = copy.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("resourceVersion");
    }
    let mut hasher = Sha256::new();
    hash_canonical(&copy, &mut hasher);
    hasher.finalize().into()
}

/// Feeds `value` to `hasher` as JSON with every object's keys sorted.
fn hash_canonical(value: &Value, hasher: &mut Sha256) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            hasher.update(b"{");
            for key in keys {
                hasher.update(
                    serde_json::to_string(key)
                        .expect("strings serialize")
                        .as_bytes(),
                );
                hasher.update(b":");
                hash_canonical(&map[key], hasher);
                hasher.update(b",");
            }
            hasher.update(b"}");
        }
        Value::Array(items) => {
            hasher.update(b"[");
            for item in items {
                hash_canonical(item, hasher);
                hasher.update(b",");
            }
            hasher.update(b"]");
        }
        scalar => hasher.update(scalar.to_string().as_bytes()),
    }
}

/// What the migration knows of one object in the source: the source's resourceVersion of the
/// state it copied, and that state's content hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copied {
    pub source_version: String,
    pub hash: [u8; 32],
}

/// The migration's record of one kind in the source, kept current by the copy and the mirror.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    objects: BTreeMap<ObjectKey, Copied>,
}

impl Ledger {
    /// Records that the copy now holds `object` as the source had it.
    pub fn record(&mut self, object: &Value) {
        let version = object["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        self.objects.insert(
            ObjectKey::of(object),
            Copied {
                source_version: version,
                hash: content_hash(object),
            },
        );
    }

    /// Records that the object is gone from the source (and from the copy).
    pub fn forget(&mut self, key: &ObjectKey) {
        self.objects.remove(key);
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    pub fn get(&self, key: &ObjectKey) -> Option<&Copied> {
        self.objects.get(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.objects.keys()
    }
}

/// What brings the copy in line with the source once the source is fenced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncPlan {
    /// In the source at a version the copy does not hold: read and write again.
    pub fetch: Vec<ObjectKey>,
    /// In the copy (or the ledger) but not in the source: remove from the copy.
    pub remove: Vec<ObjectKey>,
}

impl SyncPlan {
    pub fn is_empty(&self) -> bool {
        self.fetch.is_empty() && self.remove.is_empty()
    }
}

/// Compares the source's listing (key and resourceVersion of every object, from a
/// metadata-only list taken behind the fence) with the ledger and with the keys the database
/// holds for the kind.
pub fn sync_plan(
    ledger: &Ledger,
    source: &BTreeMap<ObjectKey, String>,
    in_database: &BTreeSet<ObjectKey>,
) -> SyncPlan {
    let fetch = source
        .iter()
        .filter(|(key, version)| {
            ledger
                .get(key)
                .is_none_or(|c| &c.source_version != *version)
                || !in_database.contains(key)
        })
        .map(|(key, _)| key.clone())
        .collect();
    let remove = ledger
        .keys()
        .chain(in_database.iter())
        .filter(|key| !source.contains_key(key))
        .cloned()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    SyncPlan { fetch, remove }
}

/// A difference found by [`verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    MissingInDatabase(ObjectKey),
    NotInSource(ObjectKey),
    ContentDiffers(ObjectKey),
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::MissingInDatabase(k) => {
                write!(f, "{k} is in the source but not in the database")
            }
            Mismatch::NotInSource(k) => write!(f, "{k} is in the database but not in the source"),
            Mismatch::ContentDiffers(k) => {
                write!(f, "{k} differs between the source and the database")
            }
        }
    }
}

/// Compares the ledger (the source as last seen) with the content hashes of what the database
/// holds for the kind: counts and every object.
pub fn verify(ledger: &Ledger, database: &BTreeMap<ObjectKey, [u8; 32]>) -> Vec<Mismatch> {
    let mut out = Vec::new();
    for (key, copied) in &ledger.objects {
        match database.get(key) {
            None => out.push(Mismatch::MissingInDatabase(key.clone())),
            Some(hash) if *hash != copied.hash => out.push(Mismatch::ContentDiffers(key.clone())),
            Some(_) => {}
        }
    }
    out.extend(
        database
            .keys()
            .filter(|k| ledger.get(k).is_none())
            .map(|k| Mismatch::NotInSource(k.clone())),
    );
    out
}

/// How far above the source's revision our resourceVersions start after a takeover. Between the
/// last read of the source and the switch, etcd keeps counting (every write in the cluster bumps
/// its revision, and watch bookmarks hand those revisions out); 2^32 more writes in that window
/// is out of reach, so no revision a client can hold ever names one of our versions.
pub const VERSION_FLOOR_MARGIN: i64 = 1 << 32;

/// The resourceVersion floor for a takeover after the source was last read at `source_revision`.
/// Every version a client got from etcd is below it, so a watch or an exact list from one gets
/// 410 Gone and relists instead of resuming at a wrong place.
pub fn version_floor(source_revision: i64) -> i64 {
    source_revision.saturating_add(VERSION_FLOOR_MARGIN)
}

/// Name of the ValidatingAdmissionPolicy (and its binding) that fences the source.
pub const FENCE_NAME: &str = "reports-server-migration-fence";

/// The name of the dry-run object that checks the fence holds.
pub const FENCE_PROBE_NAME: &str = "reports-server-migration-fence-probe";

/// Group of the probe CRD: a kind of our own, always served from CRD storage, that the fence
/// covers too. The fence can be checked on it while the report groups are still routed to us,
/// that is before a hand-back gives them to kube-apiserver (whose admission only runs for what
/// it serves itself).
pub const PROBE_GROUP: &str = "migration.reportsserver.io";
/// Plural of the probe kind `FenceProbe` (cluster-scoped, never stored: only dry-run creates).
pub const PROBE_PLURAL: &str = "fenceprobes";
/// Kind of the probe CRD.
pub const PROBE_KIND: &str = "FenceProbe";

/// The probe CRD (see [`PROBE_GROUP`]).
pub fn probe_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": format!("{PROBE_PLURAL}.{PROBE_GROUP}"),
            "labels": {"app.kubernetes.io/name": "reports-server", "app.kubernetes.io/component": "migration"},
        },
        "spec": {
            "group": PROBE_GROUP,
            "scope": "Cluster",
            "names": {"plural": PROBE_PLURAL, "singular": "fenceprobe", "kind": PROBE_KIND, "listKind": "FenceProbeList"},
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    })
}

/// The message clients see while the fence stands.
pub const FENCE_MESSAGE: &str = "reports are being moved to reports-server; this write is refused for a few seconds while the switch happens, retry it";

/// The ValidatingAdmissionPolicy and binding that refuse every create, update and delete of the
/// report kinds of `groups` in the CRD storage while the copy is brought up to date and the
/// APIServices are switched. kube-apiserver runs admission only for what it serves itself, so
/// once a group is routed to us the fence no longer touches it.
///
/// With `exempt_user`, that user's writes pass (the hand-back to CRD storage writes through
/// kube-apiserver behind the fence), except a dry-run probe named [`FENCE_PROBE_NAME`], so the
/// engine can still check that the fence holds. The fence also covers creates of the probe kind
/// ([`probe_crd`]), where it can be checked before the report groups are served by
/// kube-apiserver.
pub fn fence(groups: &[&str], exempt_user: Option<&str>) -> (Value, Value) {
    let mut rules: Vec<Value> = groups
        .iter()
        .map(|g| {
            json!({
                "apiGroups": [g],
                "apiVersions": ["*"],
                "resources": ["*"],
                "operations": ["CREATE", "UPDATE", "DELETE"],
            })
        })
        .collect();
    rules.push(json!({
        "apiGroups": [PROBE_GROUP],
        "apiVersions": ["*"],
        "resources": [PROBE_PLURAL],
        "operations": ["CREATE"],
    }));
    let labels = json!({"app.kubernetes.io/name": "reports-server", "app.kubernetes.io/component": "migration"});
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": FENCE_NAME, "labels": labels},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": rules},
            "validations": [{"expression": "false", "message": FENCE_MESSAGE, "reason": "Forbidden"}],
        },
    });
    let mut policy = policy;
    if let Some(user) = exempt_user {
        let user = serde_json::to_string(user).expect("strings serialize");
        policy["spec"]["matchConditions"] = json!([{
            "name": "not-the-migration",
            "expression": format!(
                "request.userInfo.username != {user} || (object != null && object.metadata.name == '{FENCE_PROBE_NAME}')"
            ),
        }]);
    }
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": FENCE_NAME, "labels": labels},
        "spec": {"policyName": FENCE_NAME, "validationActions": ["Deny"]},
    });
    (policy, binding)
}

/// Where the switched APIServices send their group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceTarget {
    pub namespace: String,
    pub name: String,
    pub port: i32,
    /// PEM of the CA that signed the server's certificate.
    pub ca_bundle_pem: String,
}

/// The label kube-apiserver's autoregister controller puts on the APIServices it manages for
/// CRDs; without it, the controller leaves the object alone.
pub const AUTOMANAGED_LABEL: &str = "kube-aggregator.kubernetes.io/automanaged";

/// The JSON merge patch that routes an APIService to `target`, taking it away from
/// kube-apiserver's autoregister controller.
pub fn takeover_patch(target: &ServiceTarget) -> Value {
    use base64::Engine as _;
    json!({
        "metadata": {"labels": {AUTOMANAGED_LABEL: null, "app.kubernetes.io/name": "reports-server"}},
        "spec": {
            "service": {"namespace": target.namespace, "name": target.name, "port": target.port},
            "caBundle": base64::engine::general_purpose::STANDARD.encode(target.ca_bundle_pem.as_bytes()),
            "insecureSkipTLSVerify": false,
        },
    })
}

/// The JSON merge patch that gives an APIService back to kube-apiserver: no Service (Local), and
/// the automanaged label so the autoregister controller manages it again.
pub fn handback_patch() -> Value {
    json!({
        "metadata": {"labels": {AUTOMANAGED_LABEL: "true", "app.kubernetes.io/name": null}},
        "spec": {"service": null, "caBundle": null, "insecureSkipTLSVerify": null},
    })
}

/// Server-owned metadata that CRD storage assigns itself on create.
const ASSIGNED_ON_CREATE: [&str; 6] = [
    "resourceVersion",
    "uid",
    "creationTimestamp",
    "generation",
    "managedFields",
    "selfLink",
];

/// An object as it is created in CRD storage: without what the storage assigns itself.
pub fn for_create(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(meta) = copy.get_mut("metadata").and_then(Value::as_object_mut) {
        for f in ASSIGNED_ON_CREATE {
            meta.remove(f);
        }
    }
    copy
}

/// The content compared after a hand-back: everything but what CRD storage assigns itself.
pub fn portable_hash(object: &Value) -> [u8; 32] {
    content_hash(&for_create(object))
}

/// Whether an APIService already routes to `target`.
pub fn routes_to(apiservice: &Value, target: &ServiceTarget) -> bool {
    let s = &apiservice["spec"]["service"];
    s["namespace"] == json!(target.namespace) && s["name"] == json!(target.name)
}

/// Whether an APIService is served by kube-apiserver itself (CRD or built-in storage).
pub fn is_local(apiservice: &Value) -> bool {
    apiservice["spec"]["service"].is_null()
}

/// The APIService name of a kind's group and version.
pub fn apiservice_name(resource: &ResourceDescriptor) -> String {
    format!("{}.{}", resource.version, resource.group)
}

/// What the hand-back does to one object already in CRD storage (or not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handback {
    Create,
    /// Replace at this resourceVersion of the CRD storage.
    Update(String),
    Unchanged,
}

/// Decides the hand-back of one object from its copy in CRD storage, if any.
pub fn handback(ours: &Value, theirs: Option<&Value>) -> Handback {
    match theirs {
        None => Handback::Create,
        Some(t) if portable_hash(t) == portable_hash(ours) => Handback::Unchanged,
        Some(t) => Handback::Update(
            t["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        ),
    }
}

/// Copy progress of one kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct KindProgress {
    pub kind: String,
    /// Objects in the source when its list was taken.
    pub total: u64,
    /// Objects written from the list so far.
    pub copied: u64,
    /// Changes applied from the source's watch after its list.
    pub mirrored: u64,
    /// Objects fetched or removed by the final sync behind the fence.
    pub synced: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(ns: &str, name: &str, rv: &str, summary: i64) -> Value {
        json!({
            "apiVersion": "wgpolicyk8s.io/v1alpha2",
            "kind": "PolicyReport",
            "metadata": {"namespace": ns, "name": name, "uid": format!("uid-{name}"), "resourceVersion": rv},
            "summary": {"pass": summary},
        })
    }

    fn key(ns: &str, name: &str) -> ObjectKey {
        ObjectKey {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn the_hash_ignores_the_resource_version_only() {
        let a = report("ns", "a", "10", 1);
        assert_eq!(content_hash(&a), content_hash(&report("ns", "a", "999", 1)));
        assert_ne!(content_hash(&a), content_hash(&report("ns", "a", "10", 2)));
        assert_ne!(content_hash(&a), content_hash(&report("ns2", "a", "10", 1)));
        // Key order is not content: kube-apiserver sorts keys, the server keeps the client's.
        let reordered: Value = serde_json::from_str(
            r#"{"summary": {"pass": 1}, "kind": "PolicyReport", "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "metadata": {"uid": "uid-a", "name": "a", "namespace": "ns", "resourceVersion": "3"}}"#,
        )
        .unwrap();
        assert_eq!(content_hash(&a), content_hash(&reordered));
        // Arrays keep their order.
        assert_ne!(
            content_hash(&json!({"a": [1, 2]})),
            content_hash(&json!({"a": [2, 1]}))
        );
    }

    #[test]
    fn the_sync_plan_fetches_what_changed_and_removes_what_is_gone() {
        let mut ledger = Ledger::default();
        for (name, rv) in [
            ("same", "1"),
            ("changed", "2"),
            ("deleted", "3"),
            ("lost", "4"),
        ] {
            ledger.record(&report("ns", name, rv, 0));
        }
        let source: BTreeMap<_, _> = [
            (key("ns", "same"), "1".to_string()),
            (key("ns", "changed"), "7".to_string()),
            (key("ns", "new"), "8".to_string()),
            (key("ns", "lost"), "4".to_string()),
        ]
        .into();
        // "lost" is in the ledger but not in the database (a write that failed): fetched again;
        // "stray" is in the database only (left from an earlier run): removed.
        let database: BTreeSet<_> = [
            key("ns", "same"),
            key("ns", "changed"),
            key("ns", "deleted"),
            key("ns", "stray"),
        ]
        .into();
        let plan = sync_plan(&ledger, &source, &database);
        assert_eq!(
            plan.fetch,
            vec![key("ns", "changed"), key("ns", "lost"), key("ns", "new")]
        );
        assert_eq!(plan.remove, vec![key("ns", "deleted"), key("ns", "stray")]);
    }

    #[test]
    fn an_agreeing_copy_needs_no_sync_and_verifies() {
        let mut ledger = Ledger::default();
        let objects: Vec<Value> = (0..5)
            .map(|i| report("ns", &format!("r{i}"), &i.to_string(), i))
            .collect();
        objects.iter().for_each(|o| ledger.record(o));
        let source = objects
            .iter()
            .map(|o| {
                (
                    ObjectKey::of(o),
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                )
            })
            .collect();
        let keys = objects.iter().map(ObjectKey::of).collect();
        assert!(sync_plan(&ledger, &source, &keys).is_empty());
        // The database holds the same objects at its own versions.
        let database = objects
            .iter()
            .map(|o| {
                let mut ours = o.clone();
                ours["metadata"]["resourceVersion"] = json!("4294967999");
                (ObjectKey::of(o), content_hash(&ours))
            })
            .collect();
        assert_eq!(verify(&ledger, &database), vec![]);
    }

    #[test]
    fn verify_names_every_difference() {
        let mut ledger = Ledger::default();
        ledger.record(&report("ns", "a", "1", 1));
        ledger.record(&report("ns", "b", "1", 1));
        let database: BTreeMap<_, _> = [
            (key("ns", "a"), content_hash(&report("ns", "a", "1", 2))),
            (key("ns", "c"), content_hash(&report("ns", "c", "1", 1))),
        ]
        .into();
        assert_eq!(
            verify(&ledger, &database),
            vec![
                Mismatch::ContentDiffers(key("ns", "a")),
                Mismatch::MissingInDatabase(key("ns", "b")),
                Mismatch::NotInSource(key("ns", "c")),
            ]
        );
    }

    #[test]
    fn the_hand_back_creates_updates_or_leaves_alone() {
        let ours = report("ns", "a", "4294967300", 1);
        assert_eq!(handback(&ours, None), Handback::Create);
        let mut theirs = report("ns", "a", "17", 1);
        theirs["metadata"]["uid"] = json!("another-uid");
        theirs["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert_eq!(handback(&ours, Some(&theirs)), Handback::Unchanged);
        theirs["summary"]["pass"] = json!(2);
        assert_eq!(
            handback(&ours, Some(&theirs)),
            Handback::Update("17".into())
        );
        let created = for_create(&ours);
        assert!(
            created["metadata"].get("uid").is_none()
                && created["metadata"].get("resourceVersion").is_none()
        );
        assert_eq!(created["metadata"]["name"], "a");
    }

    #[test]
    fn the_floor_is_far_above_the_source_revision() {
        assert_eq!(version_floor(12_345), 12_345 + (1 << 32));
        assert_eq!(version_floor(i64::MAX - 1), i64::MAX);
    }

    #[test]
    fn the_fence_refuses_every_write_to_the_groups() {
        let (policy, binding) = fence(&["wgpolicyk8s.io", "reports.kyverno.io"], None);
        let rules = policy["spec"]["matchConstraints"]["resourceRules"]
            .as_array()
            .unwrap();
        assert_eq!(rules.len(), 3, "two groups and the probe kind");
        assert_eq!(
            rules[0]["operations"],
            json!(["CREATE", "UPDATE", "DELETE"])
        );
        assert_eq!(rules[2]["apiGroups"], json!([PROBE_GROUP]));
        assert_eq!(rules[2]["resources"], json!([PROBE_PLURAL]));
        let crd = probe_crd();
        assert_eq!(crd["spec"]["group"], PROBE_GROUP);
        assert_eq!(crd["spec"]["names"]["plural"], PROBE_PLURAL);
        assert_eq!(
            crd["metadata"]["name"],
            format!("{PROBE_PLURAL}.{PROBE_GROUP}")
        );
        assert_eq!(policy["spec"]["validations"][0]["expression"], "false");
        assert_eq!(binding["spec"]["policyName"], FENCE_NAME);
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
        assert!(policy["spec"]["matchConditions"].is_null());
        let (policy, _) = fence(
            &["wgpolicyk8s.io"],
            Some("system:serviceaccount:rs:migrator"),
        );
        let condition = policy["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .unwrap();
        assert!(
            condition.contains(r#"!= "system:serviceaccount:rs:migrator""#),
            "{condition}"
        );
        assert!(condition.contains(FENCE_PROBE_NAME), "{condition}");
    }

    #[test]
    fn the_takeover_patch_drops_the_automanaged_label() {
        let target = ServiceTarget {
            namespace: "reports-server".into(),
            name: "reports-server".into(),
            port: 443,
            ca_bundle_pem: "PEM".into(),
        };
        let patch = takeover_patch(&target);
        assert_eq!(patch["metadata"]["labels"][AUTOMANAGED_LABEL], Value::Null);
        assert_eq!(patch["spec"]["caBundle"], "UEVN");
        let local = json!({"spec": {"group": "g", "version": "v"}});
        assert!(is_local(&local) && !routes_to(&local, &target));
        let routed =
            json!({"spec": {"service": {"namespace": "reports-server", "name": "reports-server"}}});
        assert!(!is_local(&routed) && routes_to(&routed, &target));
    }
}
