//! Reconcile paths against a mocked API server (`tower_test::mock`, as in controller-rs).
//!
//! The mock is a small in-memory API server rather than a fixed script of requests: it answers
//! GET/POST/PUT/PATCH (apply, merge, JSON patch)/DELETE on any path from a map of objects and
//! records every call. Each test then asserts what the reconciler did (which objects it
//! applied, in which order it deleted, what status it wrote) without pinning incidental call
//! order. APIServices it applies come back `Available=True` and workloads come back ready,
//! as kube-aggregator and the kubelet would eventually report.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use reports_server_crds::reportsserver::*;
use reports_server_operator::analytics::{Connection, SqlRunner};
use reports_server_operator::http::Metrics;
use reports_server_operator::{Context, OperatorConfig, controller};
use serde_json::{Value, json};

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    calls: Vec<(String, String)>,
    rv: u64,
}

type Shared = Arc<Mutex<State>>;

const RS_PATH: &str =
    "/apis/reportsserver.io/v1alpha1/namespaces/reports-server/reportsservers/reports-server";

fn not_found(path: &str) -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("{path} not found")}),
    )
}

/// Object path without query, e.g. `/api/v1/namespaces/x/secrets/y`.
fn object_path(path: &str, body: &Value) -> String {
    match body["metadata"]["name"].as_str() {
        Some(name) if !path.ends_with(name) => format!("{path}/{name}"),
        _ => path.to_string(),
    }
}

fn handle(state: &Shared, method: &str, uri: &http::Uri, body: Vec<u8>) -> (u16, Value) {
    let path = uri.path().to_string();
    let query = uri.query().unwrap_or_default().to_string();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut s = state.lock().unwrap();
    s.calls
        .push((method.to_string(), format!("{path}?{query}")));
    s.rv += 1;
    let rv = s.rv.to_string();
    if path.contains("/events") {
        return (201, body);
    }
    match method {
        "GET" => match s.objects.get(&path) {
            Some(o) => (200, o.clone()),
            None => not_found(&path),
        },
        "POST" => {
            let key = object_path(&path, &body);
            if s.objects.contains_key(&key) {
                return (
                    409,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists", "code": 409}),
                );
            }
            let mut o = body;
            o["metadata"]["resourceVersion"] = json!(rv);
            s.objects.insert(key, o.clone());
            (201, o)
        }
        "PUT" => {
            let mut o = body;
            o["metadata"]["resourceVersion"] = json!(rv);
            s.objects.insert(path, o.clone());
            (200, o)
        }
        "DELETE" => match s.objects.remove(&path) {
            Some(o) => (200, o),
            None => not_found(&path),
        },
        "PATCH" if path.ends_with("/status") => {
            let key = path.trim_end_matches("/status").to_string();
            let Some(o) = s.objects.get_mut(&key) else {
                return not_found(&key);
            };
            json_patch::merge(o, &body);
            (200, o.clone())
        }
        "PATCH" if query.contains("fieldManager") => {
            // Server-side apply: the applied object plus what the cluster would report.
            let mut o = body;
            let prev_gen = s
                .objects
                .get(&path)
                .and_then(|p| p["metadata"]["generation"].as_i64())
                .unwrap_or(0);
            o["metadata"]["resourceVersion"] = json!(rv);
            o["metadata"]["generation"] = json!(prev_gen + 1);
            match o["kind"].as_str() {
                Some("APIService") => {
                    o["status"] = json!({"conditions": [{"type": "Available", "status": "True", "reason": "Passed", "message": "all checks passed", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
                }
                Some("ConfigMap") => {
                    // Keys another field manager wrote (the server's migration worker) stay.
                    let mut data = s
                        .objects
                        .get(&path)
                        .map(|p| p["data"].clone())
                        .unwrap_or(json!({}));
                    json_patch::merge(&mut data, &o["data"]);
                    o["data"] = data;
                }
                Some("Deployment") | Some("StatefulSet") => {
                    let n = o["spec"]["replicas"].as_i64().unwrap_or(1);
                    o["status"] = json!({"observedGeneration": prev_gen + 1, "readyReplicas": n, "updatedReplicas": n, "replicas": n});
                }
                _ => {}
            }
            s.objects.insert(path, o.clone());
            (200, o)
        }
        "PATCH" if body.is_object() => {
            // A JSON merge patch.
            let Some(o) = s.objects.get_mut(&path) else {
                return not_found(&path);
            };
            json_patch::merge(o, &body);
            (200, o.clone())
        }
        "PATCH" => {
            let Some(o) = s.objects.get_mut(&path) else {
                return not_found(&path);
            };
            let patch: json_patch::Patch = serde_json::from_value(body).expect("a JSON patch");
            // kube-apiserver's JSON patch treats a missing field as null for `test`.
            if o["metadata"].get("finalizers").is_none() {
                o["metadata"]["finalizers"] = Value::Null;
            }
            if json_patch::patch(o, &patch).is_err() {
                return (
                    422,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422}),
                );
            }
            o["metadata"]["resourceVersion"] = json!(rv);
            (200, o.clone())
        }
        _ => (405, Value::Null),
    }
}

fn mock_client(state: Shared) -> Client {
    let (service, mut handle_) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        use http_body_util::BodyExt;
        while let Some((request, send)) = handle_.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes().to_vec())
                .unwrap_or_default();
            let (code, value) = handle(&state, parts.method.as_str(), &parts.uri, bytes);
            let response = Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&value).unwrap()))
                .unwrap();
            send.send_response(response);
        }
    });
    Client::new(service, "default")
}

struct Fixture {
    state: Shared,
    ctx: Arc<Context>,
}

/// The operator's PostgreSQL, as far as the analysts' grants go: records what it is asked to
/// run, and fails while `failing` holds a message.
#[derive(Default)]
struct Sql {
    runs: Mutex<Vec<(Connection, Vec<String>)>>,
    failing: Mutex<Option<String>>,
}

impl Sql {
    fn runs(&self) -> Vec<(Connection, Vec<String>)> {
        std::mem::take(&mut self.runs.lock().unwrap())
    }
}

impl SqlRunner for Sql {
    fn run<'a>(
        &'a self,
        connection: &'a Connection,
        statements: &'a [String],
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        self.runs
            .lock()
            .unwrap()
            .push((connection.clone(), statements.to_vec()));
        let result = match self.failing.lock().unwrap().clone() {
            Some(message) => Err(message),
            None => Ok(()),
        };
        Box::pin(async move { result })
    }
}

impl Fixture {
    fn new() -> Self {
        Self::with_sql(Arc::new(Sql::default()))
    }

    /// The same API server, with an operator that has just (re)started: nothing in memory.
    fn restarted(&self, sql: Arc<Sql>) -> Self {
        let client = mock_client(self.state.clone());
        let ctx = Arc::new(
            Context::new(client, OperatorConfig::default(), Metrics::new()).with_sql_runner(sql),
        );
        Fixture {
            state: self.state.clone(),
            ctx,
        }
    }

    /// With `sql` in place of the operator's PostgreSQL connection.
    fn with_sql(sql: Arc<Sql>) -> Self {
        let state: Shared = Arc::default();
        let client = mock_client(state.clone());
        let ctx = Arc::new(
            Context::new(client, OperatorConfig::default(), Metrics::new()).with_sql_runner(sql),
        );
        Fixture { state, ctx }
    }

    fn put(&self, path: &str, obj: Value) {
        self.state.lock().unwrap().objects.insert(path.into(), obj);
    }

    fn get(&self, path: &str) -> Option<Value> {
        self.state.lock().unwrap().objects.get(path).cloned()
    }

    fn calls(&self) -> Vec<(String, String)> {
        std::mem::take(&mut self.state.lock().unwrap().calls)
    }

    /// Stores the ReportsServer (with the finalizer already added, generation `generation`).
    fn put_rs(&self, spec: Value, generation: i64) {
        let mut rs = json!({
            "apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
            "metadata": {"name": "reports-server", "namespace": "reports-server", "uid": "uid-1",
                         "generation": generation, "resourceVersion": "1",
                         "finalizers": ["reportsserver.io/cleanup"]},
            "spec": spec,
        });
        if let Some(old) = self.get(RS_PATH)
            && !old["status"].is_null()
        {
            rs["status"] = old["status"].clone();
        }
        self.put(RS_PATH, rs);
    }

    async fn reconcile(&self) -> kube::runtime::controller::Action {
        self.try_reconcile().await.expect("reconcile succeeds")
    }

    async fn try_reconcile(&self) -> Result<kube::runtime::controller::Action, controller::Error> {
        let rs: ReportsServer = serde_json::from_value(self.get(RS_PATH).unwrap()).unwrap();
        controller::reconcile(Arc::new(rs), self.ctx.clone()).await
    }

    /// What the server's migration worker writes into the mailbox.
    fn worker_reports(&self, fields: Value) {
        let mut cm = self
            .get(MAILBOX_PATH)
            .expect("the operator created the mailbox");
        json_patch::merge(&mut cm["data"], &fields);
        self.put(MAILBOX_PATH, cm);
    }

    fn condition(&self, type_: &str) -> Value {
        let rs = self.get(RS_PATH).unwrap();
        rs["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned())
            .unwrap_or(Value::Null)
    }
}

const MAILBOX_PATH: &str = "/api/v1/namespaces/reports-server/configmaps/reports-server-migration";

const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";

fn apiservice_path(name: &str) -> String {
    format!("/apis/apiregistration.k8s.io/v1/apiservices/{name}")
}

fn applied(calls: &[(String, String)]) -> Vec<String> {
    calls
        .iter()
        .filter(|(m, p)| m == "PATCH" && p.contains("fieldManager=reports-server-operator"))
        .map(|(_, p)| p.split('?').next().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn fresh_install_adds_the_finalizer_then_applies_and_becomes_ready() {
    let f = Fixture::new();
    // As created by kubectl: no finalizer yet.
    f.put(
        RS_PATH,
        json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
               "metadata": {"name": "reports-server", "namespace": "reports-server", "uid": "uid-1", "generation": 1, "resourceVersion": "1"},
               "spec": {}}),
    );
    f.reconcile().await;
    assert_eq!(
        f.get(RS_PATH).unwrap()["metadata"]["finalizers"],
        json!(["reportsserver.io/cleanup"])
    );
    assert!(
        applied(&f.calls()).is_empty(),
        "nothing is applied before the finalizer is in place"
    );

    f.reconcile().await;
    let paths = applied(&f.calls());
    for path in [
        "/api/v1/namespaces/reports-server/secrets/reports-server-ca",
        "/api/v1/namespaces/reports-server/secrets/reports-server-tls",
        "/api/v1/namespaces/reports-server/serviceaccounts/reports-server",
        "/api/v1/namespaces/reports-server/services/reports-server",
        "/apis/apps/v1/namespaces/reports-server/statefulsets/reports-server",
        "/apis/policy/v1/namespaces/reports-server/poddisruptionbudgets/reports-server",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/reportsserver:reports-server:reports-server:server",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings/reportsserver:reports-server:reports-server:auth-reader",
    ] {
        assert!(
            paths.contains(&path.to_string()),
            "{path} not applied: {paths:#?}"
        );
    }
    // The APIServices come last, once what serves them exists.
    let first_api = paths
        .iter()
        .position(|p| p.contains("apiservices"))
        .unwrap();
    assert!(
        paths[first_api..].iter().all(|p| p.contains("apiservices")),
        "{paths:#?}"
    );
    let ca = f
        .get("/api/v1/namespaces/reports-server/secrets/reports-server-ca")
        .unwrap();
    let api = f.get(&apiservice_path("v1alpha2.wgpolicyk8s.io")).unwrap();
    use base64::Engine as _;
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(api["spec"]["caBundle"].as_str().unwrap())
        .unwrap();
    assert_eq!(
        String::from_utf8(bundle).unwrap(),
        ca["stringData"]["ca.crt"].as_str().unwrap()
    );
    assert!(api["spec"].get("insecureSkipTLSVerify").is_none());

    let ready = f.condition("Ready");
    assert_eq!(ready["status"], "True", "{ready}");
    let rs = f.get(RS_PATH).unwrap();
    assert_eq!(rs["status"]["observedGeneration"], 1);
    assert_eq!(rs["status"]["database"]["type"], "sqlite");
    assert_eq!(rs["status"]["groups"].as_array().unwrap().len(), 3);

    // A second pass changes nothing in status (no status write, no new transition).
    f.reconcile().await;
    let calls = f.calls();
    assert!(
        !calls
            .iter()
            .any(|(m, p)| m == "PATCH" && p.contains("/status")),
        "{calls:#?}"
    );
    assert!(
        !applied(&calls).iter().any(|p| p.contains("secrets")),
        "certificates are reused, not reissued"
    );
}

#[tokio::test]
async fn spec_change_updates_objects_removes_a_turned_off_group_and_observes_the_generation() {
    let f = Fixture::new();
    let spec = json!({"external": {"host": "localhost", "port": 6443, "caBundle": CA}});
    f.put_rs(spec.clone(), 1);
    f.reconcile().await;
    assert_eq!(f.condition("Ready")["status"], "True");
    let t1 = f.condition("Ready")["lastTransitionTime"].clone();
    f.calls();

    let mut spec2 = spec;
    spec2["external"]["port"] = json!(7443);
    spec2["groups"] = json!({"openreports": false});
    // Without the hand-back a turned-off group's APIService is deleted at once.
    spec2["migration"] = json!({"handBackOnDelete": false});
    f.put_rs(spec2, 2);
    f.reconcile().await;
    let calls = f.calls();
    assert!(
        calls
            .iter()
            .any(|(m, p)| m == "DELETE"
                && p.starts_with(&apiservice_path("v1alpha1.openreports.io"))),
        "{calls:#?}"
    );
    assert!(f.get(&apiservice_path("v1alpha1.openreports.io")).is_none());
    assert_eq!(
        f.get(&apiservice_path("v1.reports.kyverno.io")).unwrap()["spec"]["service"]["port"],
        7443
    );
    assert_eq!(
        f.get("/api/v1/namespaces/reports-server/services/reports-server")
            .unwrap()["spec"]["ports"][0]["port"],
        7443
    );
    let rs = f.get(RS_PATH).unwrap();
    assert_eq!(rs["status"]["observedGeneration"], 2);
    assert_eq!(rs["status"]["groups"].as_array().unwrap().len(), 2);
    assert_eq!(
        f.condition("Ready")["lastTransitionTime"],
        t1,
        "Ready stayed True: no transition"
    );
    assert_eq!(f.condition("Ready")["observedGeneration"], 2);
}

#[tokio::test]
async fn missing_database_secret_or_key_is_degraded_naming_both_and_recovers() {
    let f = Fixture::new();
    f.put_rs(json!({"replicas": 2, "database": {"postgres": {"external": {"secretName": "reports-db"}}}}), 1);
    f.reconcile().await;
    let degraded = f.condition("Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "DatabaseSecretMissing");
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("reports-server/reports-db"),
        "{degraded}"
    );
    assert_eq!(f.condition("Stalled")["status"], "True");
    assert_eq!(f.condition("Ready")["status"], "False");
    assert!(
        applied(&f.calls()).is_empty(),
        "nothing is applied without a usable database"
    );

    f.put(
        "/api/v1/namespaces/reports-server/secrets/reports-db",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "reports-db", "namespace": "reports-server"},
               "data": {"host": "aG9zdA==", "database": "ZGI=", "username": "dQ=="}}),
    );
    f.reconcile().await;
    let degraded = f.condition("Degraded");
    assert_eq!(degraded["reason"], "DatabaseSecretKeyMissing");
    let message = degraded["message"].as_str().unwrap();
    assert!(
        message.contains("reports-db")
            && message.contains("\"password\"")
            && message.contains("passwordKey"),
        "{message}"
    );

    // Fixing the Secret is enough: the next (requeued) reconcile installs and becomes Ready.
    f.put(
        "/api/v1/namespaces/reports-server/secrets/reports-db",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "reports-db", "namespace": "reports-server"},
               "data": {"host": "aG9zdA==", "database": "ZGI=", "username": "dQ==", "password": "cA=="}}),
    );
    f.reconcile().await;
    assert_eq!(f.condition("Degraded")["status"], "False");
    assert_eq!(f.condition("Ready")["status"], "True");
    let deployment = f
        .get("/apis/apps/v1/namespaces/reports-server/deployments/reports-server")
        .unwrap();
    assert_eq!(deployment["spec"]["replicas"], 2);
    assert_eq!(
        deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"],
        0
    );
}

#[tokio::test]
async fn sqlite_with_two_replicas_is_refused_with_a_condition() {
    let f = Fixture::new();
    f.put_rs(json!({"replicas": 2}), 1);
    f.reconcile().await;
    let stalled = f.condition("Stalled");
    assert_eq!(stalled["reason"], "SqliteSingleReplica");
    assert!(applied(&f.calls()).is_empty());
}

#[tokio::test]
async fn apiservice_of_someone_else_is_left_alone_unless_takeover_is_asked() {
    let f = Fixture::new();
    let foreign = json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": "v1.reports.kyverno.io", "labels": {"kube-aggregator.kubernetes.io/automanaged": "true"}},
        "spec": {"group": "reports.kyverno.io", "version": "v1", "groupPriorityMinimum": 1000, "versionPriority": 15}});
    f.put(&apiservice_path("v1.reports.kyverno.io"), foreign.clone());
    // With the migration off (on, the group is migrated: see below).
    let spec = json!({"external": {"host": "localhost", "port": 6443, "caBundle": CA}, "migration": {"enabled": false}});
    f.put_rs(spec.clone(), 1);
    f.reconcile().await;
    let applied_paths = applied(&f.calls());
    assert!(
        !applied_paths.contains(&apiservice_path("v1.reports.kyverno.io")),
        "{applied_paths:#?}"
    );
    assert!(applied_paths.contains(&apiservice_path("v1alpha2.wgpolicyk8s.io")));
    assert_eq!(
        f.get(&apiservice_path("v1.reports.kyverno.io")).unwrap(),
        foreign
    );
    let degraded = f.condition("Degraded");
    assert_eq!(degraded["reason"], "APIServiceOwnedByOther");
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("v1.reports.kyverno.io")
    );
    let rs = f.get(RS_PATH).unwrap();
    let group = rs["status"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["apiService"] == "v1.reports.kyverno.io")
        .unwrap()
        .clone();
    assert_eq!(group["reason"], "OwnedByOther");
    assert!(
        group["message"]
            .as_str()
            .unwrap()
            .contains("Local (CRD storage)"),
        "{group}"
    );

    let mut spec2 = spec;
    spec2["apiServices"] = json!({"takeOver": true});
    f.put_rs(spec2, 2);
    f.reconcile().await;
    let taken = f.get(&apiservice_path("v1.reports.kyverno.io")).unwrap();
    assert_eq!(
        taken["metadata"]["labels"]["kube-aggregator.kubernetes.io/automanaged"],
        "false"
    );
    assert_eq!(
        taken["metadata"]["annotations"]["reportsserver.io/owner"],
        "reports-server/reports-server"
    );
    assert_eq!(f.condition("Ready")["status"], "True");
    let rs = f.get(RS_PATH).unwrap();
    assert!(
        rs["status"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["apiService"] == "v1.reports.kyverno.io" && g["takenOver"] == true)
    );
}

#[tokio::test]
async fn deletion_removes_apiservices_first_then_cluster_objects_and_nothing_else() {
    let f = Fixture::new();
    f.put_rs(json!({"migration": {"handBackOnDelete": false}}), 1);
    f.reconcile().await;
    // Someone else's APIService and ClusterRole that must survive.
    let other = json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": "v1beta1.metrics.k8s.io"}});
    f.put(&apiservice_path("v1beta1.metrics.k8s.io"), other);
    f.calls();

    let mut rs = f.get(RS_PATH).unwrap();
    rs["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    f.put(RS_PATH, rs);
    f.reconcile().await;
    let deletes: Vec<String> = f
        .calls()
        .into_iter()
        .filter(|(m, _)| m == "DELETE")
        .map(|(_, p)| p.split('?').next().unwrap().to_string())
        .collect();
    assert_eq!(deletes.len(), 10, "{deletes:#?}");
    assert!(
        deletes[..3].iter().all(|p| p.contains("/apiservices/")),
        "APIServices first: {deletes:#?}"
    );
    assert!(
        deletes[3..9]
            .iter()
            .all(|p| p.contains("rbac.authorization.k8s.io")),
        "{deletes:#?}"
    );
    // Last, the release account, which nothing owns.
    assert!(
        deletes[7..]
            .iter()
            .all(|p| p.ends_with("/reports-server-release")),
        "{deletes:#?}"
    );
    assert!(deletes[9].contains("/serviceaccounts/"), "{deletes:#?}");
    assert!(f.get(&apiservice_path("v1beta1.metrics.k8s.io")).is_some());
    // The finalizer is gone, so the API server can finish the deletion; namespaced objects
    // follow through their ownerReferences.
    assert_eq!(f.get(RS_PATH).unwrap()["metadata"]["finalizers"], json!([]));
    let sts = f
        .get("/apis/apps/v1/namespaces/reports-server/statefulsets/reports-server")
        .unwrap();
    assert_eq!(sts["metadata"]["ownerReferences"][0]["uid"], "uid-1");
}

fn local_apiservice(name: &str) -> Value {
    let (version, group) = name.split_once('.').unwrap();
    json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": name, "labels": {"kube-aggregator.kubernetes.io/automanaged": "true"}},
        "spec": {"group": group, "version": version, "groupPriorityMinimum": 1000, "versionPriority": 15}})
}

#[tokio::test]
async fn a_local_group_is_left_to_the_migration_and_adopted_once_switched() {
    let f = Fixture::new();
    let name = "v1.reports.kyverno.io";
    f.put(&apiservice_path(name), local_apiservice(name));
    f.put_rs(
        json!({"external": {"host": "localhost", "port": 6443, "caBundle": CA}}),
        1,
    );
    f.reconcile().await;
    let applied_paths = applied(&f.calls());
    assert!(
        !applied_paths.contains(&apiservice_path(name)),
        "{applied_paths:#?}"
    );
    assert_eq!(
        f.get(&apiservice_path(name)).unwrap(),
        local_apiservice(name)
    );
    assert_eq!(
        f.get(MAILBOX_PATH).unwrap()["data"]["groups"],
        "wgpolicyk8s.io,reports.kyverno.io,openreports.io"
    );
    let ready = f.condition("Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("Migrating"))
    );
    assert_eq!(
        f.condition("Degraded")["status"],
        "False",
        "a migration is not a fault"
    );

    // The worker reports progress; the status shows it per kind.
    f.worker_reports(json!({
        "observedGroups": "openreports.io,reports.kyverno.io,wgpolicyk8s.io",
        "phase": "Copying",
        "progress": r#"[{"kind":"EphemeralReport","total":40,"copied":25,"mirrored":3,"synced":0}]"#,
    }));
    f.reconcile().await;
    let rs = f.get(RS_PATH).unwrap();
    let m = &rs["status"]["migration"];
    assert_eq!(m["phase"], "Copying");
    assert_eq!(
        (m["copied"].as_i64(), m["total"].as_i64()),
        (Some(25), Some(40))
    );
    assert_eq!(m["kinds"][0]["mirrored"], 3);
    assert!(
        f.condition("Ready")["message"]
            .as_str()
            .unwrap()
            .contains("25 of 40")
    );

    // Switched by the worker: adopted, Ready, and the migration conditions all True.
    let mut switched = local_apiservice(name);
    switched["metadata"]["labels"] = json!({});
    switched["spec"]["service"] =
        json!({"namespace": "reports-server", "name": "reports-server", "port": 6443});
    f.put(&apiservice_path(name), switched);
    f.worker_reports(json!({"phase": "Complete", "progress": "[]", "lastRun": r#"{"copyObjectsPerSecond": 300.0, "fenceSeconds": 3.2, "switchSeconds": 0.4}"#}));
    f.reconcile().await;
    assert!(applied(&f.calls()).contains(&apiservice_path(name)));
    let adopted = f.get(&apiservice_path(name)).unwrap();
    assert_eq!(
        adopted["metadata"]["annotations"]["reportsserver.io/owner"],
        "reports-server/reports-server"
    );
    assert_eq!(f.condition("Ready")["status"], "True");
    let rs = f.get(RS_PATH).unwrap();
    let m = &rs["status"]["migration"];
    assert_eq!(m["phase"], "Complete");
    assert_eq!(m["lastRun"]["objectsPerSecond"], "300.0");
    for c in m["conditions"].as_array().unwrap() {
        assert_eq!(c["status"], "True", "{c}");
    }
    assert_eq!(m["kinds"][0]["total"], 40, "the last counts stay");
}

#[tokio::test]
async fn deletion_waits_for_the_hand_back_then_releases_the_apiservices() {
    let f = Fixture::new();
    f.put_rs(
        json!({"external": {"host": "localhost", "port": 6443, "caBundle": CA}}),
        1,
    );
    f.reconcile().await;
    // The server's migration worker runs (it has reported once).
    f.worker_reports(json!({
        "observedGroups": "openreports.io,reports.kyverno.io,wgpolicyk8s.io",
        "phase": "Complete",
    }));
    f.calls();
    let mut rs = f.get(RS_PATH).unwrap();
    rs["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    f.put(RS_PATH, rs);

    // The server has not handed back yet: nothing deleted, the mailbox asks for no group.
    let err = f.try_reconcile().await.expect_err("deletion waits");
    assert!(err.to_string().contains("handBackOnDelete: false"), "{err}");
    let deletes: Vec<_> = f
        .calls()
        .into_iter()
        .filter(|(m, _)| m == "DELETE")
        .collect();
    assert!(deletes.is_empty(), "{deletes:#?}");
    assert_eq!(f.get(MAILBOX_PATH).unwrap()["data"]["groups"], "");
    assert_eq!(
        f.get(RS_PATH).unwrap()["metadata"]["finalizers"],
        json!(["reportsserver.io/cleanup"])
    );
    let action = controller::error_policy(
        Arc::new(serde_json::from_value(f.get(RS_PATH).unwrap()).unwrap()),
        &err,
        f.ctx.clone(),
    );
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(f.ctx.config.progress_requeue),
        "no backoff while waiting"
    );

    // Writing back: progress in status.
    f.worker_reports(json!({"observedGroups": "", "phase": "WritingBack",
        "progress": r#"[{"kind":"PolicyReport","total":10,"copied":4}]"#}));
    f.try_reconcile().await.expect_err("still waiting");
    let m = f.get(RS_PATH).unwrap()["status"]["migration"].clone();
    assert_eq!(
        (m["phase"].as_str(), m["copied"].as_i64()),
        (Some("WritingBack"), Some(4))
    );
    assert_eq!(m["conditions"][0]["type"], "HandedBack");
    assert_eq!(m["conditions"][0]["status"], "False");

    // Handed back: the APIServices are Local again and survive, released; the finalizer goes.
    for name in [
        "v1alpha2.wgpolicyk8s.io",
        "v1.reports.kyverno.io",
        "v1alpha1.openreports.io",
    ] {
        let mut a = f.get(&apiservice_path(name)).unwrap();
        a["spec"]["service"] = Value::Null;
        a["metadata"]["labels"]["kube-aggregator.kubernetes.io/automanaged"] = json!("true");
        f.put(&apiservice_path(name), a);
    }
    f.worker_reports(json!({"phase": "Complete", "progress": "[]"}));
    f.reconcile().await;
    for name in [
        "v1alpha2.wgpolicyk8s.io",
        "v1.reports.kyverno.io",
        "v1alpha1.openreports.io",
    ] {
        let a = f
            .get(&apiservice_path(name))
            .expect("a handed-back APIService stays");
        assert!(
            a["metadata"]["annotations"]["reportsserver.io/owner"].is_null(),
            "{a}"
        );
    }
    let rs = f.get(RS_PATH).unwrap();
    assert_eq!(rs["metadata"]["finalizers"], json!([]));
    assert_eq!(rs["status"]["migration"]["conditions"][0]["status"], "True");
}

const ANALYTICS_SECRET: &str = "/api/v1/namespaces/reports-server/secrets/reports-server-analytics";

fn secret_value(secret: &Value, key: &str) -> String {
    secret["stringData"][key]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn the_analysts_role_is_granted_on_the_managed_postgres_and_dropped_when_turned_off() {
    let sql = Arc::new(Sql::default());
    let f = Fixture::with_sql(sql.clone());
    let spec = json!({"database": {"postgres": {"managed": {}}},
                      "analytics": {"readOnlyRole": {"enabled": true}}});
    f.put_rs(spec.clone(), 1);
    // The database does not answer yet: said in the condition, the reports are served anyway.
    *sql.failing.lock().unwrap() = Some("connection refused".into());
    f.reconcile().await;
    let access = f.condition("AnalyticsAccess");
    assert_eq!(
        (access["status"].as_str(), access["reason"].as_str()),
        (Some("False"), Some("RoleNotReady")),
        "{access}"
    );
    assert!(
        access["message"]
            .as_str()
            .unwrap()
            .contains("connection refused")
    );
    assert_eq!(f.condition("Ready")["status"], "True");
    let secret = f.get(ANALYTICS_SECRET).expect("the analysts' Secret");
    let password = secret_value(&secret, "password");
    assert_eq!(password.len(), 32);
    assert_eq!(secret_value(&secret, "username"), "reports_analytics");
    assert_eq!(
        secret_value(&secret, "host"),
        "reports-server-postgres.reports-server.svc"
    );
    assert_eq!(
        secret_value(&secret, "REPORTS_SERVER_DATABASE_URL"),
        format!(
            "postgres://reports_analytics:{password}@reports-server-postgres.reports-server.svc:5432/reports"
        )
    );
    assert_eq!(secret["metadata"]["ownerReferences"][0]["uid"], "uid-1");
    assert_eq!(
        secret["metadata"]["labels"]["reportsserver.io/secret"], "analytics",
        "marked as the analysts' Secret"
    );
    sql.runs();

    // It answers: the grants run as the superuser, with the Secret's password for the role.
    *sql.failing.lock().unwrap() = None;
    f.reconcile().await;
    let runs = sql.runs();
    assert_eq!(runs.len(), 1, "{runs:#?}");
    let (admin, statements) = &runs[0];
    let superuser = f
        .get("/api/v1/namespaces/reports-server/secrets/reports-server-postgres")
        .unwrap();
    assert_eq!(
        (admin.user.as_str(), admin.password.as_str()),
        ("reports", secret_value(&superuser, "password").as_str())
    );
    assert_eq!(
        statements,
        &reports_server_operator::analytics::managed_statements(Some(&password))
    );
    assert_eq!(f.condition("AnalyticsAccess")["reason"], "RoleReady");
    let noted = f.get(ANALYTICS_SECRET).unwrap();
    assert_eq!(
        noted["stringData"], secret["stringData"],
        "the Secret's data is never rewritten"
    );
    let sha = noted["metadata"]["annotations"]["reportsserver.io/password-sha256"]
        .as_str()
        .expect("the password set is noted")
        .to_owned();
    assert_eq!(sha.len(), 64);
    assert!(!sha.contains(&password));
    // Converged: the next reconciles do not reconnect.
    f.reconcile().await;
    assert!(sql.runs().is_empty());
    // A restarted operator converges again, without sending the password again.
    let sql_after = Arc::new(Sql::default());
    let after = f.restarted(sql_after.clone());
    after.reconcile().await;
    let runs = sql_after.runs();
    assert_eq!(
        runs.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>(),
        [reports_server_operator::analytics::managed_statements(None)]
    );
    assert!(!format!("{runs:?}").contains(&password));
    // The role was dropped by hand: created again, with the password.
    *sql_after.failing.lock().unwrap() =
        Some(reports_server_operator::analytics::ROLE_MISSING.into());
    let again = f.restarted(sql_after.clone());
    again.reconcile().await;
    let runs = sql_after.runs();
    assert_eq!(runs.len(), 2, "{runs:#?}");
    assert_eq!(
        runs[1].1,
        reports_server_operator::analytics::managed_statements(Some(&password))
    );
    *sql_after.failing.lock().unwrap() = None;

    // Turned off: the role is dropped, the Secret deleted, the condition gone.
    let mut off = spec;
    off["analytics"]["readOnlyRole"]["enabled"] = json!(false);
    f.put_rs(off, 2);
    f.reconcile().await;
    let runs = sql.runs();
    assert_eq!(
        runs.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>(),
        [reports_server_operator::analytics::drop_statements(
            "reports_analytics"
        )]
    );
    assert!(f.get(ANALYTICS_SECRET).is_none());
    assert!(f.condition("AnalyticsAccess").is_null());
    // And nothing more is asked of the database afterwards.
    f.reconcile().await;
    assert!(sql.runs().is_empty());
}

/// `secretName` naming a Secret the operator keeps for something else: nothing read, nothing
/// run, nothing deleted, neither on nor off.
#[tokio::test]
async fn the_analysts_secret_name_may_not_name_another_secret_of_the_operator() {
    let sql = Arc::new(Sql::default());
    let f = Fixture::with_sql(sql.clone());
    let postgres = "/api/v1/namespaces/reports-server/secrets/reports-server-postgres";
    let spec = json!({"database": {"postgres": {"managed": {}}},
                      "analytics": {"readOnlyRole": {"enabled": true, "secretName": "reports-server-postgres"}}});
    f.put_rs(spec.clone(), 1);
    f.reconcile().await;
    let access = f.condition("AnalyticsAccess");
    assert_eq!(
        (access["status"].as_str(), access["reason"].as_str()),
        (Some("False"), Some("AnalyticsSecretNameReserved")),
        "{access}"
    );
    assert!(
        sql.runs().is_empty(),
        "no role gets the superuser's password"
    );
    let before = f.get(postgres).expect("the PostgreSQL password Secret");
    let mut off = spec;
    off["analytics"]["readOnlyRole"]["enabled"] = json!(false);
    f.put_rs(off, 2);
    f.reconcile().await;
    assert!(sql.runs().is_empty());
    assert_eq!(
        f.get(postgres).expect("not deleted")["metadata"]["uid"],
        before["metadata"]["uid"]
    );

    // A Secret of that name the operator did not write for the analysts: neither read nor
    // deleted.
    let other = "/api/v1/namespaces/reports-server/secrets/someones";
    f.put(
        other,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "someones", "namespace": "reports-server",
                            "ownerReferences": [{"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
                                                 "name": "reports-server", "uid": "uid-1"}]},
               "stringData": {"password": "not-for-analysts"}}),
    );
    let spec = json!({"database": {"postgres": {"managed": {}}},
                      "analytics": {"readOnlyRole": {"enabled": true, "secretName": "someones"}}});
    f.put_rs(spec.clone(), 3);
    f.reconcile().await;
    assert_eq!(
        f.condition("AnalyticsAccess")["reason"],
        "AnalyticsSecretNotOurs"
    );
    assert!(sql.runs().is_empty());
    let mut off = spec;
    off["analytics"]["readOnlyRole"]["enabled"] = json!(false);
    f.put_rs(off, 4);
    f.reconcile().await;
    assert!(sql.runs().is_empty());
    assert!(f.get(other).is_some());
}

/// The role is removed because its Secret exists, whatever the last status said; and the
/// Secret stays, with a condition, until the role is dropped.
#[tokio::test]
async fn the_analysts_role_is_removed_even_without_the_condition_and_only_once_dropped() {
    let sql = Arc::new(Sql::default());
    let f = Fixture::with_sql(sql.clone());
    let spec = json!({"database": {"postgres": {"managed": {}}},
                      "analytics": {"readOnlyRole": {"enabled": true}}});
    f.put_rs(spec.clone(), 1);
    f.reconcile().await;
    assert_eq!(f.condition("AnalyticsAccess")["reason"], "RoleReady");
    sql.runs();
    // Turned off after a reconcile that ended early: no AnalyticsAccess condition left.
    let mut rs = f.get(RS_PATH).unwrap();
    rs["status"]["conditions"] = json!([]);
    f.put(RS_PATH, rs);
    let mut off = spec;
    off["analytics"]["readOnlyRole"]["enabled"] = json!(false);
    f.put_rs(off, 2);
    // The PostgreSQL does not answer: the role cannot be dropped yet.
    *sql.failing.lock().unwrap() = Some("connection refused".into());
    f.reconcile().await;
    let access = f.condition("AnalyticsAccess");
    assert_eq!(
        (access["status"].as_str(), access["reason"].as_str()),
        (Some("False"), Some("RoleRemovalPending")),
        "{access}"
    );
    assert!(
        f.get(ANALYTICS_SECRET).is_some(),
        "kept until the role is dropped"
    );
    *sql.failing.lock().unwrap() = None;
    sql.runs();
    f.reconcile().await;
    assert_eq!(
        sql.runs()
            .iter()
            .map(|(_, s)| s.clone())
            .collect::<Vec<_>>(),
        [reports_server_operator::analytics::drop_statements(
            "reports_analytics"
        )]
    );
    assert!(f.get(ANALYTICS_SECRET).is_none());
    assert!(f.condition("AnalyticsAccess").is_null());
}

#[tokio::test]
async fn the_analysts_role_elsewhere_is_a_condition_pointing_at_the_docs() {
    let f = Fixture::new();
    let cases = [
        (json!({}), "SqliteHasNoRoles"),
        (
            json!({"external": {"host": "localhost", "port": 6443, "caBundle": CA}}),
            "ExternalServer",
        ),
    ];
    for (generation, (mut spec, reason)) in (1..).zip(cases) {
        spec["analytics"] = json!({"readOnlyRole": {"enabled": true}});
        f.put_rs(spec, generation);
        f.reconcile().await;
        let access = f.condition("AnalyticsAccess");
        assert_eq!(access["status"], "False", "{access}");
        assert_eq!(access["reason"], reason, "{access}");
        assert!(
            access["message"]
                .as_str()
                .unwrap()
                .contains("docs/analytics-access.md"),
            "{access}"
        );
        assert_eq!(f.condition("Ready")["status"], "True");
    }
    assert!(f.get(ANALYTICS_SECRET).is_none());
}

#[tokio::test]
async fn a_service_monitor_only_where_the_prometheus_operator_api_is_served() {
    let f = Fixture::new();
    let spec =
        json!({"monitoring": {"serviceMonitor": {"enabled": true, "labels": {"release": "prom"}}}});
    f.put_rs(spec.clone(), 1);
    f.reconcile().await;
    let monitoring = f.condition("Monitoring");
    assert_eq!(
        (monitoring["status"].as_str(), monitoring["reason"].as_str()),
        (Some("False"), Some("ServiceMonitorNotServed")),
        "{monitoring}"
    );
    assert_eq!(
        f.condition("Ready")["status"],
        "True",
        "not a failed installation"
    );
    let monitor_path =
        "/apis/monitoring.coreos.com/v1/namespaces/reports-server/servicemonitors/reports-server";
    let binding_path = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/reportsserver:reports-server:reports-server:metrics-reader";
    assert!(!applied(&f.calls()).iter().any(|p| p.contains("metrics")));

    // The Prometheus Operator is installed: the ServiceMonitor and its identity appear.
    f.put(
        "/apis/monitoring.coreos.com/v1",
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "monitoring.coreos.com/v1",
               "resources": [{"name": "servicemonitors", "singularName": "servicemonitor", "namespaced": true,
                              "kind": "ServiceMonitor", "verbs": ["get", "list", "create"]}]}),
    );
    f.reconcile().await;
    let paths = applied(&f.calls());
    for path in [
        monitor_path,
        binding_path,
        "/api/v1/namespaces/reports-server/serviceaccounts/reports-server-metrics-reader",
        "/api/v1/namespaces/reports-server/secrets/reports-server-metrics-reader-token",
    ] {
        assert!(
            paths.contains(&path.to_string()),
            "{path} not applied: {paths:#?}"
        );
    }
    let monitor = f.get(monitor_path).unwrap();
    assert_eq!(monitor["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        f.get(binding_path).unwrap()["roleRef"]["name"],
        "reports-server:metrics-reader"
    );
    assert_eq!(f.condition("Monitoring")["status"], "True");

    // Turned off, even after a reconcile that dropped the condition: all of it goes, and so
    // does the condition.
    let mut rs = f.get(RS_PATH).unwrap();
    rs["status"]["conditions"] = json!([]);
    f.put(RS_PATH, rs);
    let mut off = spec.clone();
    off["monitoring"]["serviceMonitor"]["enabled"] = json!(false);
    f.put_rs(off.clone(), 2);
    f.reconcile().await;
    for path in [
        monitor_path,
        binding_path,
        "/api/v1/namespaces/reports-server/serviceaccounts/reports-server-metrics-reader",
        "/api/v1/namespaces/reports-server/secrets/reports-server-metrics-reader-token",
    ] {
        assert!(f.get(path).is_none(), "{path} left behind");
    }
    assert!(f.condition("Monitoring").is_null());

    // A ServiceMonitor of the same name that is not this ReportsServer's (a chart's) stays.
    f.put_rs(spec, 3);
    f.reconcile().await;
    let mut foreign = f.get(monitor_path).unwrap();
    foreign["metadata"]["ownerReferences"] = json!([]);
    f.put(monitor_path, foreign);
    f.put_rs(off, 4);
    f.reconcile().await;
    assert!(f.get(monitor_path).is_some(), "not ours: left alone");
    assert!(
        f.get("/api/v1/namespaces/reports-server/serviceaccounts/reports-server-metrics-reader")
            .is_none()
    );
}
