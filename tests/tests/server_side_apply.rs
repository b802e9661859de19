//! Server-side apply against the real server on SQLite and PostgreSQL, driven by `kubectl apply
//! --server-side` and kube-rs `Patch::Apply`: creation with server metadata, updates, conflicts
//! between field managers and forcing them, pruning of fields no longer applied, server dry-run,
//! ownership moving to a PUT's manager, and the OpenAPI v2 document.

use kube::api::{Api, Patch, PatchParams, PostParams};
use reports_server_crds::PolicyReport;
use reports_server_tests::Backend;
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::server::ServerProcess;
use serde_json::{Value, json};

const NS: &str = "ssa";

async fn start(backend: Backend, dir: &std::path::Path) -> ServerProcess {
    let url = backend
        .database_url(dir)
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    ServerProcess::start(dir, Some(url))
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"))
}

/// A PolicyReport manifest with the given summary counters and extra labels.
fn manifest(name: &str, summary: Value, labels: Value) -> String {
    let mut obj = json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {"name": name, "namespace": NS},
        "scope": {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "namespace": NS},
        "summary": summary,
    });
    if labels.as_object().is_some_and(|l| !l.is_empty()) {
        obj["metadata"]["labels"] = labels;
    }
    serde_json::to_string_pretty(&obj).unwrap()
}

/// `kubectl apply --server-side` with extra flags; returns (success, stdout, stderr).
fn kubectl_apply(k: &Kubectl, extra: &[&str], manifest: &str) -> (bool, String, String) {
    let mut args = vec!["apply", "--server-side", "-f", "-"];
    args.extend_from_slice(extra);
    let out = k.output(&args, Some(manifest)).expect("kubectl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kubectl_ok(k: &Kubectl, extra: &[&str], manifest: &str) -> String {
    let (ok, stdout, stderr) = kubectl_apply(k, extra, manifest);
    assert!(
        ok,
        "kubectl apply --server-side {extra:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

fn get(k: &Kubectl, name: &str) -> Value {
    let out = k
        .run(&[
            "get",
            "polr",
            name,
            "-n",
            NS,
            "-o",
            "json",
            "--show-managed-fields",
        ])
        .unwrap();
    serde_json::from_str(&out).unwrap()
}

fn exists(k: &Kubectl, name: &str) -> bool {
    let out = k
        .output(
            &[
                "get",
                "polr",
                name,
                "-n",
                NS,
                "--ignore-not-found",
                "-o",
                "name",
            ],
            None,
        )
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    !String::from_utf8_lossy(&out.stdout).trim().is_empty()
}

/// (manager, operation, fieldsV1) of every managedFields entry.
fn owners(obj: &Value) -> Vec<(String, String, Value)> {
    obj["metadata"]["managedFields"]
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .map(|e| {
                    (
                        e["manager"].as_str().unwrap_or("").to_owned(),
                        e["operation"].as_str().unwrap_or("").to_owned(),
                        e["fieldsV1"].clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn owns(obj: &Value, manager: &str, operation: &str, pointer: &str) -> bool {
    owners(obj)
        .iter()
        .any(|(m, op, f)| m == manager && op == operation && f.pointer(pointer).is_some())
}

async fn raw(
    client: &kube::Client,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, http::HeaderMap, Vec<u8>) {
    let mut request = http::Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request.body(body.as_bytes().to_vec()).unwrap();
    let response = client
        .send(request.map(kube::client::Body::from))
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, headers, bytes.to_vec())
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or(Value::Null)
}

#[tokio::test]
async fn server_side_apply_creates_missing_object_with_server_metadata() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        let out = kubectl_ok(
            &k,
            &[],
            &manifest("created", json!({"pass": 1}), json!({"team": "a"})),
        );
        assert!(
            out.contains("created serverside-applied"),
            "{backend:?}: {out}"
        );
        let obj = get(&k, "created");
        let meta = &obj["metadata"];
        assert!(
            meta["uid"].as_str().is_some_and(|u| u.len() == 36),
            "{backend:?}: {obj}"
        );
        assert!(meta["creationTimestamp"].is_string(), "{backend:?}: {obj}");
        assert_eq!(meta["generation"], 1, "{backend:?}");
        assert_eq!(meta["labels"]["team"], "a");
        assert_eq!(obj["summary"]["pass"], 1);
        let entries = meta["managedFields"].as_array().expect("managedFields");
        assert_eq!(entries.len(), 1, "{backend:?}: {obj}");
        let e = &entries[0];
        assert_eq!(
            (
                &e["manager"],
                &e["operation"],
                &e["apiVersion"],
                &e["fieldsType"]
            ),
            (
                &json!("kubectl"),
                &json!("Apply"),
                &json!("wgpolicyk8s.io/v1alpha2"),
                &json!("FieldsV1")
            ),
            "{backend:?}: {e}"
        );
        assert!(e["time"].is_string());
        assert_eq!(
            e["fieldsV1"],
            json!({"f:metadata": {"f:labels": {"f:team": {}}}, "f:scope": {}, "f:summary": {"f:pass": {}}}),
            "{backend:?}"
        );
        // Tables and metadata-only clients see the object as usual.
        let table = k.run(&["get", "polr", "-n", NS]).unwrap();
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("created") && l.contains("Pod")),
            "{table}"
        );
        let client = server.client().await.unwrap();
        let (code, _, body) = raw(
            &client,
            "GET",
            &format!("/apis/wgpolicyk8s.io/v1alpha2/namespaces/{NS}/policyreports/created"),
            &[(
                "accept",
                "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
            )],
            "",
        )
        .await;
        let partial = json_of(&body);
        assert_eq!(code, 200, "{partial}");
        assert_eq!(partial["kind"], "PartialObjectMetadata");
        assert_eq!(
            partial["metadata"]["managedFields"],
            obj["metadata"]["managedFields"]
        );
    }
}

#[tokio::test]
async fn server_side_apply_updates_and_bumps_generation_only_for_content_changes() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        kubectl_ok(&k, &[], &manifest("r", json!({"pass": 1}), json!({})));
        let out = kubectl_ok(&k, &[], &manifest("r", json!({"pass": 2}), json!({})));
        assert!(out.contains("r serverside-applied"), "{out}");
        let updated = get(&k, "r");
        assert_eq!(updated["summary"]["pass"], 2, "{backend:?}");
        assert_eq!(updated["metadata"]["generation"], 2, "{backend:?}");
        // The same configuration again writes nothing.
        kubectl_ok(&k, &[], &manifest("r", json!({"pass": 2}), json!({})));
        let again = get(&k, "r");
        assert_eq!(
            again["metadata"]["resourceVersion"], updated["metadata"]["resourceVersion"],
            "{backend:?}: a no-op apply must not write"
        );
        // Labels are metadata: no generation bump.
        kubectl_ok(
            &k,
            &[],
            &manifest("r", json!({"pass": 2}), json!({"l": "v"})),
        );
        let relabelled = get(&k, "r");
        assert_eq!(relabelled["metadata"]["labels"]["l"], "v");
        assert_eq!(relabelled["metadata"]["generation"], 2, "{backend:?}");
    }
}

#[tokio::test]
async fn second_field_manager_conflicts_until_it_forces_the_field() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        kubectl_ok(
            &k,
            &[],
            &manifest("r", json!({"pass": 1, "fail": 0}), json!({})),
        );
        let before = get(&k, "r");
        let other = manifest("r", json!({"pass": 5}), json!({}));
        let (ok, stdout, stderr) = kubectl_apply(&k, &["--field-manager=other"], &other);
        assert!(!ok, "{backend:?}: a conflicting apply succeeded: {stdout}");
        assert!(
            stderr.contains("conflict")
                && stderr.contains(".summary.pass")
                && stderr.contains("\"kubectl\""),
            "{backend:?}: {stderr}"
        );
        let unchanged = get(&k, "r");
        assert_eq!(
            unchanged["metadata"]["resourceVersion"],
            before["metadata"]["resourceVersion"]
        );
        assert_eq!(unchanged["summary"]["pass"], 1);

        kubectl_ok(&k, &["--field-manager=other", "--force-conflicts"], &other);
        let forced = get(&k, "r");
        assert_eq!(forced["summary"]["pass"], 5, "{backend:?}");
        assert!(
            owns(&forced, "other", "Apply", "/f:summary/f:pass"),
            "{forced}"
        );
        assert!(
            !owns(&forced, "kubectl", "Apply", "/f:summary/f:pass"),
            "{forced}"
        );
        assert!(
            owns(&forced, "kubectl", "Apply", "/f:summary/f:fail"),
            "{forced}"
        );
    }
}

#[tokio::test]
async fn fields_removed_from_the_applied_configuration_are_removed_from_the_object() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        kubectl_ok(
            &k,
            &[],
            &manifest(
                "r",
                json!({"pass": 1, "fail": 2}),
                json!({"keep": "1", "drop": "2"}),
            ),
        );
        kubectl_ok(
            &k,
            &[],
            &manifest("r", json!({"pass": 1}), json!({"keep": "1"})),
        );
        let obj = get(&k, "r");
        assert_eq!(obj["summary"], json!({"pass": 1}), "{backend:?}: {obj}");
        assert_eq!(
            obj["metadata"]["labels"],
            json!({"keep": "1"}),
            "{backend:?}"
        );
        assert_eq!(
            owners(&obj)[0].2,
            json!({"f:metadata": {"f:labels": {"f:keep": {}}}, "f:scope": {}, "f:summary": {"f:pass": {}}})
        );
    }
}

#[tokio::test]
async fn server_dry_run_apply_changes_nothing() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        let out = kubectl_ok(
            &k,
            &["--dry-run=server"],
            &manifest("dry", json!({"pass": 1}), json!({})),
        );
        assert!(out.contains("dry"), "{out}");
        assert!(
            !exists(&k, "dry"),
            "{backend:?}: a dry-run apply created the object"
        );
        kubectl_ok(&k, &[], &manifest("dry", json!({"pass": 1}), json!({})));
        let before = get(&k, "dry");
        kubectl_ok(
            &k,
            &["--dry-run=server"],
            &manifest("dry", json!({"pass": 9}), json!({})),
        );
        let after = get(&k, "dry");
        assert_eq!(
            after, before,
            "{backend:?}: a dry-run apply changed the object"
        );
    }
}

#[tokio::test]
async fn kube_rs_patch_apply_creates_updates_and_forces() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let api: Api<PolicyReport> = Api::namespaced(client.clone(), NS);
        let config = |pass: i64| {
            json!({
                "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "kind": "PolicyReport",
                "metadata": {"name": "rs"},
                "summary": {"pass": pass},
            })
        };
        let created = api
            .patch("rs", &PatchParams::apply("x"), &Patch::Apply(config(1)))
            .await
            .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        assert_eq!(created.metadata.generation, Some(1));
        assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
        let mf = created.metadata.managed_fields.clone().unwrap();
        assert_eq!(mf.len(), 1);
        assert_eq!(
            (mf[0].manager.as_deref(), mf[0].operation.as_deref()),
            (Some("x"), Some("Apply"))
        );
        let updated = api
            .patch("rs", &PatchParams::apply("x"), &Patch::Apply(config(2)))
            .await
            .unwrap();
        assert_eq!(updated.summary.as_ref().unwrap().pass, Some(2));
        assert_eq!(updated.metadata.generation, Some(2));
        let err = api
            .patch("rs", &PatchParams::apply("y"), &Patch::Apply(config(3)))
            .await
            .unwrap_err();
        let kube::Error::Api(status) = err else {
            panic!("{backend:?}: expected an API error, got {err}")
        };
        assert_eq!(
            (status.code, status.reason.as_str()),
            (409, "Conflict"),
            "{status:?}"
        );
        assert_eq!(
            status.message,
            "Apply failed with 1 conflict: conflict with \"x\": .summary.pass"
        );
        let forced = api
            .patch(
                "rs",
                &PatchParams::apply("y").force(),
                &Patch::Apply(config(3)),
            )
            .await
            .unwrap();
        assert_eq!(forced.summary.as_ref().unwrap().pass, Some(3));
        let managers: Vec<_> = forced
            .metadata
            .managed_fields
            .unwrap()
            .into_iter()
            .map(|e| e.manager.unwrap())
            .collect();
        assert_eq!(managers, ["y"], "{backend:?}: x lost its only field");
    }
}

#[tokio::test]
async fn put_after_apply_attributes_the_changed_field_to_the_updater() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let k = Kubectl::new(&server.kubeconfig);
        kubectl_ok(
            &k,
            &[],
            &manifest("r", json!({"pass": 1, "fail": 0}), json!({})),
        );
        let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), NS);
        let mut current = api.get("r").await.unwrap();
        current.summary.as_mut().unwrap().pass = Some(7);
        let params = PostParams {
            field_manager: Some("putter".into()),
            ..Default::default()
        };
        api.replace("r", &params, &current).await.unwrap();
        let obj = get(&k, "r");
        assert!(
            owns(&obj, "putter", "Update", "/f:summary/f:pass"),
            "{backend:?}: {obj}"
        );
        assert!(
            !owns(&obj, "kubectl", "Apply", "/f:summary/f:pass"),
            "{obj}"
        );
        assert!(owns(&obj, "kubectl", "Apply", "/f:summary/f:fail"), "{obj}");
        // Applying the old value again now conflicts with the updater.
        let (ok, _, stderr) = kubectl_apply(
            &k,
            &[],
            &manifest("r", json!({"pass": 1, "fail": 0}), json!({})),
        );
        assert!(!ok, "{backend:?}");
        assert!(
            stderr.contains("conflict with \"putter\" using wgpolicyk8s.io/v1alpha2"),
            "{stderr}"
        );
        // A merge patch is attributed the same way, with the manager taken from fieldManager.
        let patched = api
            .patch(
                "r",
                &PatchParams {
                    field_manager: Some("merger".into()),
                    ..Default::default()
                },
                &Patch::Merge(json!({"metadata": {"labels": {"m": "1"}}})),
            )
            .await
            .unwrap();
        let labels_owner = patched
            .metadata
            .managed_fields
            .unwrap()
            .into_iter()
            .find(|e| e.manager.as_deref() == Some("merger"))
            .expect("merger entry");
        assert_eq!(labels_owner.operation.as_deref(), Some("Update"));
        assert_eq!(
            labels_owner.fields_v1.unwrap().0,
            json!({"f:metadata": {"f:labels": {".": {}, "f:m": {}}}})
        );
    }
}

#[tokio::test]
async fn apply_requests_are_validated_like_kube_apiserver() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let path = format!("/apis/wgpolicyk8s.io/v1alpha2/namespaces/{NS}/policyreports/v");
        let body = manifest("v", json!({"pass": 1}), json!({}));
        let (code, _, out) = raw(
            &client,
            "PATCH",
            &path,
            &[("content-type", "application/apply-patch+yaml")],
            &body,
        )
        .await;
        let status = json_of(&out);
        assert_eq!(code, 422, "{backend:?}: {status}");
        assert_eq!(
            status["message"],
            "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
        );
        let (code, _, out) = raw(
            &client,
            "PATCH",
            &format!("{path}?fieldManager=m"),
            &[("content-type", "application/apply-patch+cbor")],
            "",
        )
        .await;
        assert_eq!(code, 415, "{}", json_of(&out));
        assert!(
            json_of(&out)["message"]
                .as_str()
                .unwrap()
                .contains("application/apply-patch+yaml")
        );
        // YAML bodies work as well as JSON; the object is created (201) with its namespace.
        let yaml = "apiVersion: wgpolicyk8s.io/v1alpha2\nkind: PolicyReport\nmetadata:\n  name: v\nsummary:\n  pass: 4\n";
        let (code, _, out) = raw(
            &client,
            "PATCH",
            &format!("{path}?fieldManager=m"),
            &[("content-type", "application/apply-patch+yaml")],
            yaml,
        )
        .await;
        let created = json_of(&out);
        assert_eq!(code, 201, "{backend:?}: {created}");
        assert_eq!(created["metadata"]["namespace"], NS);
        // force is for apply only; strategic merge stays unsupported.
        let (code, _, out) = raw(
            &client,
            "PATCH",
            &format!("{path}?force=true"),
            &[("content-type", "application/merge-patch+json")],
            "{}",
        )
        .await;
        assert_eq!(code, 422, "{}", json_of(&out));
        assert!(
            json_of(&out)["message"]
                .as_str()
                .unwrap()
                .contains("force: Forbidden")
        );
        let (code, _, _) = raw(
            &client,
            "PATCH",
            &path,
            &[("content-type", "application/strategic-merge-patch+json")],
            "{}",
        )
        .await;
        assert_eq!(code, 415);
        // A kind that does not match the URL is refused.
        let wrong = body.replace("\"PolicyReport\"", "\"ClusterPolicyReport\"");
        let (code, _, out) = raw(
            &client,
            "PATCH",
            &format!("{path}?fieldManager=m"),
            &[("content-type", "application/apply-patch+yaml")],
            &wrong,
        )
        .await;
        assert_eq!(code, 400, "{}", json_of(&out));
    }
}

#[tokio::test]
async fn openapi_v2_describes_every_kind_and_negotiates_like_kube_apiserver() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let protobuf = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf";
        let (code, headers, body) = raw(
            &client,
            "GET",
            "/openapi/v2",
            &[("accept", &format!("{protobuf}, application/json"))],
            "",
        )
        .await;
        assert_eq!(code, 200, "{backend:?}");
        assert_eq!(headers["content-type"], "application/json");
        let doc = json_of(&body);
        assert_eq!(doc["swagger"], "2.0");
        for d in &reports_server_crds::catalog::ALL {
            for kind in [d.kind, d.list_kind] {
                assert!(
                    doc["definitions"].as_object().unwrap().values().any(|def| {
                        def["x-kubernetes-group-version-kind"][0]
                            == json!({"group": d.group, "version": d.version, "kind": kind})
                    }),
                    "{backend:?}: no definition for {kind}"
                );
            }
        }
        let etag = headers["etag"].to_str().unwrap().to_owned();
        let (code, _, _) = raw(
            &client,
            "GET",
            "/openapi/v2",
            &[("if-none-match", &etag)],
            "",
        )
        .await;
        assert_eq!(code, 304);
        let (code, _, _) = raw(&client, "GET", "/openapi/v2", &[("accept", protobuf)], "").await;
        assert_eq!(code, 406);
    }
}
