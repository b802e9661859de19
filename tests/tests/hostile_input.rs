//! Hostile input against the real server binary: one test per class of docs/api.md "Limits and
//! timeouts". Each asserts the status a client gets, that the server is alive afterwards, that
//! nothing changed that must not, and the server's peak memory (VmHWM) below a stated bound.
//! The cases that do heavy work also check that an unrelated create meanwhile finishes within
//! 10× its unloaded time, with a floor of [`STALL_FLOOR`]: this is the debug build, on a 2-core
//! machine that CI shares with other test binaries.

use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::server::ServerProcess;
use serde_json::{Value, json};

const NS: &str = "team-a";
const COLLECTION: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-a/policyreports";
/// The server's body limit (its default), which the large cases fill.
const BODY_LIMIT: usize = 8 * 1024 * 1024;
/// Peak resident memory a case may add to the server's (debug build).
const MEMORY_BOUND_MIB: u64 = 96;
/// Peak resident memory a case that fills the body limit may add: 32 bytes per byte of the
/// body (handling one takes 18–25× its size for a create in the debug build).
const FULL_LIMIT_BOUND_MIB: u64 = 32 * (BODY_LIMIT as u64 >> 20);
/// An unrelated create may always take this long: a stall is seconds of a server that does
/// nothing else, while a debug build on a busy 2-core CI machine sees 0.9 s scheduling spikes
/// (an unloaded create 88 ms, the slowest meanwhile 896 ms).
const STALL_FLOOR: Duration = Duration::from_secs(2);

struct Harness {
    _dir: tempfile::TempDir,
    server: ServerProcess,
    client: kube::Client,
    baseline_mib: u64,
    /// Names for the unrelated creates, never reused.
    next_name: std::sync::atomic::AtomicU64,
}

impl Harness {
    async fn start(extra: &[&str]) -> Harness {
        Harness::start_on(None, extra).await
    }

    async fn start_on(database_url: Option<String>, extra: &[&str]) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let server = ServerProcess::start_with(dir.path(), database_url, extra)
            .await
            .expect("server starts");
        let client = server.client_without_retries().await.unwrap();
        let api: Api<PolicyReport> = Api::namespaced(client.clone(), NS);
        api.create(&PostParams::default(), &report(0))
            .await
            .unwrap();
        let baseline_mib = peak_mib(&server);
        Harness {
            _dir: dir,
            server,
            client,
            baseline_mib,
            next_name: std::sync::atomic::AtomicU64::new(1_000),
        }
    }

    async fn raw(
        &self,
        method: &str,
        uri: impl Into<String>,
        content_type: &str,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let (status, _, body) = self.raw_with_headers(method, uri, content_type, body).await;
        (status, body)
    }

    async fn raw_with_headers(
        &self,
        method: &str,
        uri: impl Into<String>,
        content_type: &str,
        body: Vec<u8>,
    ) -> (u16, http::HeaderMap, Value) {
        let uri: String = uri.into();
        let request = http::Request::builder()
            .method(method)
            .uri(&uri)
            .header("content-type", content_type)
            .body(body)
            .unwrap();
        let response = self
            .client
            .send(request.map(kube::client::Body::from))
            .await
            .unwrap_or_else(|e| panic!("{method} {uri}: {e}\n{}", self.server.log_tail()));
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(
            bytes.len() < 64 * 1024 || status < 300,
            "an error response of {} bytes",
            bytes.len()
        );
        (
            status,
            headers,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// A sample of the server's `/metrics` (0 when absent).
    async fn metric(&self, name: &str) -> f64 {
        let text = self
            .client
            .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
            .await
            .unwrap();
        reports_server_tests::plain_http::parse_prometheus(&text)
            .unwrap()
            .into_iter()
            .find(|s| s.name == name && s.labels.is_empty())
            .map_or(0.0, |s| s.value)
    }

    /// Creates report `n` as raw JSON, whatever the answer.
    async fn post_report(&self, n: u64) -> (u16, Value) {
        let body = serde_json::to_vec(&report(n)).unwrap();
        self.raw("POST", COLLECTION, "application/json", body).await
    }

    /// Starts a write that declares `content_length` bytes and sends `sent` of them, waits until
    /// the server holds them, then sends another write, which must be refused 429 with
    /// `Retry-After`; returns the held connection and the refusal's Status.
    async fn write_behind_a_slow_one(
        &self,
        content_length: usize,
        sent: usize,
    ) -> (
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        Value,
    ) {
        use tokio::io::AsyncWriteExt;
        let mut slow = tls_stream(self, true).await;
        let head = format!(
            "POST {COLLECTION} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n{{{}",
            " ".repeat(sent - 1)
        );
        slow.write_all(head.as_bytes()).await.unwrap();
        let metric = "reports_server_apiserver_request_body_bytes_in_flight";
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.metric(metric).await < sent as f64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the server never held the slow write's {sent} bytes"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let body = serde_json::to_vec(&report(9)).unwrap();
        let (status, headers, body) = self
            .raw_with_headers("POST", COLLECTION, "application/json", body)
            .await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["reason"], "TooManyRequests");
        assert_eq!(body["details"]["retryAfterSeconds"], 1);
        assert_eq!(
            headers.get("retry-after").and_then(|v| v.to_str().ok()),
            Some("1"),
            "client-go retries a 429 only with the header"
        );
        (slow, body)
    }

    /// The server answers, the seeded report is as it was, and its peak memory stayed bounded.
    async fn assert_healthy(&self, case: &str, before: &Value) {
        self.assert_healthy_within(case, before, MEMORY_BOUND_MIB)
            .await;
    }

    async fn assert_healthy_within(&self, case: &str, before: &Value, bound_mib: u64) {
        let (status, now) = self
            .raw(
                "GET",
                &format!("{COLLECTION}/report-00000"),
                "application/json",
                Vec::new(),
            )
            .await;
        assert_eq!(status, 200, "{case}: the server must still answer");
        assert_eq!(
            now["metadata"]["resourceVersion"], before["metadata"]["resourceVersion"],
            "{case}: the report must not change"
        );
        let grown = peak_mib(&self.server).saturating_sub(self.baseline_mib);
        eprintln!("[hostile] {case}: peak memory +{grown} MiB");
        assert!(
            grown <= bound_mib,
            "{case}: peak memory grew by {grown} MiB (bound {bound_mib} MiB)"
        );
    }

    async fn seeded(&self) -> Value {
        self.raw(
            "GET",
            &format!("{COLLECTION}/report-00000"),
            "application/json",
            Vec::new(),
        )
        .await
        .1
    }

    /// Runs `hostile` while creating unrelated reports; asserts none took over 10× (and over
    /// the floor) the unloaded create time.
    async fn with_unrelated_creates<F: std::future::Future<Output = T>, T>(
        &self,
        case: &str,
        hostile: F,
    ) -> T {
        let (result, slowest, bound) = self.measure_unrelated_creates(case, hostile).await;
        assert!(
            slowest <= bound,
            "{case}: a create took {slowest:?} (bound {bound:?})"
        );
        result
    }

    /// As [`Self::with_unrelated_creates`], printing the figures without a bound.
    async fn with_unrelated_creates_measured<F: std::future::Future<Output = T>, T>(
        &self,
        case: &str,
        hostile: F,
    ) -> T {
        self.measure_unrelated_creates(case, hostile).await.0
    }

    async fn measure_unrelated_creates<F: std::future::Future<Output = T>, T>(
        &self,
        case: &str,
        hostile: F,
    ) -> (T, Duration, Duration) {
        let api: Api<PolicyReport> = Api::namespaced(self.client.clone(), NS);
        let mut unloaded = Vec::new();
        let name = || {
            self.next_name
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        };
        for _ in 0..5 {
            let started = Instant::now();
            api.create(&PostParams::default(), &report(name()))
                .await
                .unwrap();
            unloaded.push(started.elapsed());
        }
        unloaded.sort();
        let unloaded = unloaded[2];
        let bound = (unloaded * 10).max(STALL_FLOOR);
        let creates = async {
            let mut slowest = Duration::ZERO;
            for _ in 0..40 {
                let started = Instant::now();
                api.create(&PostParams::default(), &report(name()))
                    .await
                    .unwrap();
                slowest = slowest.max(started.elapsed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            slowest
        };
        let (result, slowest) = tokio::join!(hostile, creates);
        eprintln!("[hostile] {case}: unloaded create {unloaded:?}, slowest meanwhile {slowest:?}");
        (result, slowest, bound)
    }
}

/// The answer has `code` and a message naming `text`.
fn refused((status, body): (u16, Value), code: u16, text: &str) {
    assert_eq!(status, code, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains(text), "{text:?} not in {body}");
}

fn report(n: u64) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(NS, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(format!("report-{n:05}"));
    r
}

/// The server process's peak resident set (VmHWM), MiB.
fn peak_mib(server: &ServerProcess) -> u64 {
    let pid = server.pid().expect("the server runs");
    reports_server_tests::proc_status::kib(pid, "VmHWM").expect("VmHWM") / 1024
}

/// Operations that nest `{"spec": …}` one level deeper per three, about 120 bytes each, up to
/// `bytes` of patch; the first adds an annotation of `padding` bytes.
fn nesting_patch(bytes: usize, padding: usize) -> Vec<u8> {
    let triple = r#"{"op":"add","path":"/b","value":{}},{"op":"move","from":"/spec","path":"/b/spec"},{"op":"move","from":"/b","path":"/spec"},"#;
    let mut patch = format!(
        r#"[{{"op":"add","path":"/metadata/annotations","value":{{"pad":"{}"}}}},{{"op":"add","path":"/spec","value":{{}}}},"#,
        "p".repeat(padding)
    );
    while patch.len() + triple.len() < bytes - 64 {
        patch += triple;
    }
    patch += r#"{"op":"test","path":"/kind","value":"PolicyReport"}]"#;
    patch.into_bytes()
}

#[tokio::test]
async fn a_json_patch_that_nests_deeper_than_the_limit_is_refused_at_the_full_body_limit() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    // At the full body limit a patch of these operations has more than kube-apiserver's 10,000.
    let (status, body) = h
        .with_unrelated_creates(
            "deep patch, full limit",
            h.raw(
                "PATCH",
                format!("{COLLECTION}/report-00000"),
                "application/json-patch+json",
                nesting_patch(BODY_LIMIT - 1024, 0),
            ),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    // Padded to the full limit with fewer operations: refused at the nesting limit.
    let patch = nesting_patch(BODY_LIMIT - 1024, BODY_LIMIT - 380_000);
    for uri in [
        format!("{COLLECTION}/report-00000"),
        format!("{COLLECTION}/report-00000?dryRun=All"),
    ] {
        let (status, body) = h
            .with_unrelated_creates(
                "deep patch",
                h.raw("PATCH", uri, "application/json-patch+json", patch.clone()),
            )
            .await;
        refused((status, body), 422, "levels deep");
    }
    h.assert_healthy_within("deep patch", &before, FULL_LIMIT_BOUND_MIB)
        .await;
}

#[tokio::test]
async fn json_patch_copies_operations_and_results_are_bounded() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    let uri = format!("{COLLECTION}/report-00000");
    // Each copy doubles the document: 30 would make it 2^30 times its size.
    let mut ops = vec![json!({"op": "add", "path": "/x", "value": {"r": "y".repeat(4096)}})];
    ops.extend((0..30).map(|i| json!({"op": "copy", "from": "/x", "path": format!("/x/c{i}")})));
    let (status, body) = h
        .raw(
            "PATCH",
            &uri,
            "application/json-patch+json",
            serde_json::to_vec(&ops).unwrap(),
        )
        .await;
    assert!(matches!(status, 413 | 422), "{status} {body}");
    let many: Vec<Value> = (0..10_001)
        .map(|_| json!({"op": "test", "path": "/kind", "value": "PolicyReport"}))
        .collect();
    let (status, body) = h
        .raw(
            "PATCH",
            &uri,
            "application/json-patch+json",
            serde_json::to_vec(&many).unwrap(),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    // Two merge patches within the body limit whose result is not.
    let api: Api<PolicyReport> = Api::namespaced(h.client.clone(), NS);
    api.create(&PostParams::default(), &report(99))
        .await
        .unwrap();
    let other = format!("{COLLECTION}/report-00099");
    let half =
        |key: &str| json!({"metadata": {"annotations": {key: "x".repeat(BODY_LIMIT / 2 + 1024)}}});
    let (status, body) = h
        .raw(
            "PATCH",
            other.clone(),
            "application/merge-patch+json",
            serde_json::to_vec(&half("a")).unwrap(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = h
        .raw(
            "PATCH",
            other,
            "application/merge-patch+json",
            serde_json::to_vec(&half("b")).unwrap(),
        )
        .await;
    assert_eq!(status, 413, "{body}");
    h.assert_healthy_within("json patch bounds", &before, FULL_LIMIT_BOUND_MIB)
        .await;
}

#[tokio::test]
async fn client_managed_fields_are_bounded_at_the_full_body_limit() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    let entry_fields = |i: usize| {
        let mut fields = serde_json::Map::new();
        for j in 0..40 {
            fields.insert(format!("f:k{i:05}-{j:02}"), json!({}));
        }
        json!({"f:metadata": {"f:labels": fields}})
    };
    let entry = |i: usize| json!({"manager": format!("m{i:05}"), "operation": "Update", "apiVersion": "wgpolicyk8s.io/v1alpha2", "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": entry_fields(i)});
    // As many entries as fit under the body limit (all of one size: five-digit names).
    let room = BODY_LIMIT - 16 * 1024 - serde_json::to_vec(&before).unwrap().len();
    let count = room / (serde_json::to_vec(&entry(0)).unwrap().len() + 1);
    let mut object = before.clone();
    object["metadata"]["managedFields"] = (0..count).map(entry).collect();
    eprintln!("[hostile] managedFields: {count} entries");
    let uri = format!("{COLLECTION}/report-00000");
    let (status, body) = h
        .with_unrelated_creates(
            "managedFields",
            h.raw(
                "PUT",
                &uri,
                "application/json",
                serde_json::to_vec(&object).unwrap(),
            ),
        )
        .await;
    refused((status, body), 422, "managedFields");
    h.assert_healthy_within("managedFields", &before, FULL_LIMIT_BOUND_MIB)
        .await;
}

#[tokio::test]
async fn writes_at_the_full_body_limit_are_stored_and_measured() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    // A valid report of as many results as fit under the limit.
    let mut big = serde_json::to_value(report(50)).unwrap();
    let result = big["results"][0].clone();
    let each = serde_json::to_vec(&result).unwrap().len() + 16;
    big["results"] = (0..(BODY_LIMIT - 64 * 1024) / each)
        .map(|i| {
            let mut r = result.clone();
            r["policy"] = json!(format!("policy-{i:06}"));
            r
        })
        .collect();
    let body = serde_json::to_vec(&big).unwrap();
    // The database work of a write grows with it (a row per result); a write at the body
    // limit is measured here, not bounded: a writer in the same group commit round waits for it.
    let (status, created) = h
        .with_unrelated_creates_measured(
            "full-limit create",
            h.raw("POST", COLLECTION, "application/json", body),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let mut replaced = created.clone();
    replaced["results"][0]["result"] = json!("fail");
    let uri = format!("{COLLECTION}/report-00050");
    let (status, body) = h
        .with_unrelated_creates_measured(
            "full-limit update",
            h.raw(
                "PUT",
                uri,
                "application/json",
                serde_json::to_vec(&replaced).unwrap(),
            ),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // Legitimate, not hostile: a full-limit report (some 32,000 results) is parsed, checked against
    // the schema, stored with a row per result and kept for watchers, old and new side by side.
    h.assert_healthy_within("full-limit writes", &before, 2 * FULL_LIMIT_BOUND_MIB)
        .await;
}

#[tokio::test]
async fn bookkeeping_of_duplicate_keys_yaml_aliases_and_field_managers_is_bounded() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    // Duplicate keys on a deep path of long keys: every duplicate noted would render it.
    let key = "k".repeat(500);
    let mut deep = String::new();
    for _ in 0..100 {
        deep += &format!("{{\"{key}\":");
    }
    let mut leaf = String::from("{");
    for i in 0..3000 {
        leaf += &format!("\"d{}\": {i},", i % 10);
    }
    leaf += "\"end\": 0}";
    let body = format!(
        r#"{{"apiVersion":"wgpolicyk8s.io/v1alpha2","kind":"PolicyReport","metadata":{{"name":"deep-dups"}},"scope":{deep}{leaf}{}}}"#,
        "}".repeat(100)
    );
    let (status, _) = h
        .raw(
            "POST",
            &format!("{COLLECTION}?fieldValidation=Strict"),
            "application/json",
            body.into_bytes(),
        )
        .await;
    assert_eq!(status, 400);
    let mut body = String::from(
        r#"{"apiVersion":"wgpolicyk8s.io/v1alpha2","kind":"PolicyReport","metadata":{"name":"dups"},"scope":{"#,
    );
    for i in 0..4000 {
        body += &format!("\"x{}\": 1, \"x{}\": 2,", i % 50, i % 50);
    }
    body += r#""end": 0}}"#;
    let (status, _) = h
        .raw(
            "POST",
            &format!("{COLLECTION}?fieldValidation=Strict"),
            "application/json",
            body.into_bytes(),
        )
        .await;
    assert_eq!(status, 400);
    // YAML aliases to one large scalar.
    let mut yaml = format!(
        "apiVersion: wgpolicyk8s.io/v1alpha2\nkind: PolicyReport\nmetadata:\n  name: laughs\n  annotations:\n    a: &a \"{}\"\n",
        "x".repeat(50_000)
    );
    yaml += "results: [";
    yaml += &vec!["{policy: *a}"; 1_000].join(", ");
    yaml += "]\n";
    let (status, body) = h
        .raw("POST", COLLECTION, "application/yaml", yaml.into_bytes())
        .await;
    assert_eq!(status, 400, "{body}");
    // A field manager of control characters in an 8 KiB URL.
    let manager = "%01".repeat(2_600);
    let (status, body) = h
        .raw(
            "POST",
            &format!("{COLLECTION}?fieldManager={manager}"),
            "application/json",
            serde_json::to_vec(&report(7)).unwrap(),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    h.assert_healthy("bookkeeping", &before).await;
}

#[tokio::test]
async fn parameters_at_the_edges_get_400_504_or_are_clamped() {
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    let get = |q: String| {
        h.raw(
            "GET",
            format!("{COLLECTION}?{q}"),
            "application/json",
            Vec::new(),
        )
    };
    let terms: Vec<String> = (0..933).map(|i| format!("k{i}=v")).collect();
    assert_eq!(
        get(format!("labelSelector={}", terms.join(","))).await.0,
        400
    );
    let names: Vec<String> = (0..100).map(|i| format!("metadata.name!=n{i}")).collect();
    assert_eq!(
        get(format!("fieldSelector={}", names.join(","))).await.0,
        400
    );
    let (status, list) = get("limit=9223372036854775807".into()).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    for bad in ["-1", "abc", "99999999999999999999"] {
        assert_eq!(
            get(format!("resourceVersion={bad}")).await.0,
            400,
            "resourceVersion={bad}"
        );
    }
    // A watch from the future is refused, not opened silently.
    let (status, body) = get("watch=true&resourceVersion=999999999".into()).await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(
        body["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
    // A continue token forged with a future version.
    let (_, page) = get("limit=1".into()).await;
    let api: Api<PolicyReport> = Api::namespaced(h.client.clone(), NS);
    api.create(&PostParams::default(), &report(1))
        .await
        .unwrap();
    let (_, page) = if page["metadata"]["continue"].is_null() {
        get("limit=1".into()).await
    } else {
        (200, page)
    };
    let token = page["metadata"]["continue"]
        .as_str()
        .expect("a continue token");
    use base64::Engine as _;
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut decoded: Value =
        serde_json::from_slice(&engine.decode(token.trim_end_matches('=')).unwrap()).unwrap();
    let field = decoded
        .as_object()
        .unwrap()
        .keys()
        .find(|k| k.contains("rv") || k.contains("resource"))
        .cloned()
        .expect("a version field");
    decoded[&field] = json!(999_999_999);
    let forged = engine.encode(serde_json::to_vec(&decoded).unwrap());
    let (status, body) = get(format!("limit=1&continue={forged}")).await;
    assert_eq!(status, 504, "{body}");
    h.assert_healthy("parameters", &before).await;
}

#[tokio::test]
async fn a_watch_by_name_matches_the_name_exactly() {
    let h = Harness::start(&[]).await;
    // The watch ends after its timeout without an event for report-00000.
    let request = http::Request::builder()
        .uri(format!(
            "{COLLECTION}/=report-00000?watch=true&timeoutSeconds=2"
        ))
        .body(Vec::new())
        .unwrap();
    let text = h.client.request_text(request).await.unwrap();
    assert!(!text.contains("report-00000"), "{text}");
    let request = http::Request::builder()
        .uri(format!(
            "{COLLECTION}/report-00000?watch=true&timeoutSeconds=1"
        ))
        .body(Vec::new())
        .unwrap();
    let text = h.client.request_text(request).await.unwrap();
    assert!(
        text.contains("report-00000"),
        "the exact name still matches: {text}"
    );
}

/// TLS to the server as the kubeconfig's user (`authenticated`) or as nobody.
fn tls_connector(kubeconfig: &std::path::Path, authenticated: bool) -> tokio_rustls::TlsConnector {
    use base64::Engine as _;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config: Value =
        serde_yaml::from_str(&std::fs::read_to_string(kubeconfig).unwrap()).unwrap();
    let field = |path: &[&str]| {
        let mut v = &config;
        for p in path {
            v = if let Ok(i) = p.parse::<usize>() {
                &v[i]
            } else {
                &v[*p]
            };
        }
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("a kubeconfig field"))
            .unwrap()
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&field(&[
        "clusters",
        "0",
        "cluster",
        "certificate-authority-data",
    ])) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    let config = if authenticated {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&field(&[
            "users",
            "0",
            "user",
            "client-certificate-data",
        ]))
        .map(Result::unwrap)
        .collect();
        let key = PrivateKeyDer::from_pem_slice(&field(&["users", "0", "user", "client-key-data"]))
            .unwrap();
        builder.with_client_auth_cert(certs, key).unwrap()
    } else {
        builder.with_no_client_auth()
    };
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

async fn tls_stream(
    h: &Harness,
    authenticated: bool,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", h.server.port))
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    tls_connector(&h.server.kubeconfig, authenticated)
        .connect(name, tcp)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_before_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::start(&[]).await;
    let before = h.seeded().await;
    let mut tls = tls_stream(&h, true).await;
    let head = format!(
        "POST {COLLECTION} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{{"
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut answer))
        .await
        .expect("answered without waiting for the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    h.assert_healthy("content-length", &before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_connections_are_closed_within_the_header_timeout_while_kubectl_works() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const TIMEOUT: Duration = Duration::from_secs(3);
    const CONNECTIONS: usize = 1_000;
    let h = Harness::start(&[
        "--header-read-timeout-seconds",
        "3",
        "--tls-handshake-timeout-seconds",
        "3",
    ])
    .await;
    let before = h.seeded().await;
    let connector = tls_connector(&h.server.kubeconfig, false);
    let port = h.server.port;
    let mut held = Vec::new();
    for i in 0..CONNECTIONS {
        // In batches, so the listen backlog (and not the server) is never what holds them.
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let connector = connector.clone();
        held.push(tokio::spawn(async move {
            let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let opened = Instant::now();
            let mut buf = [0u8; 1024];
            // A third never starts TLS, a third stops after it, a third sends half a request.
            if i % 3 == 0 {
                while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
                return opened.elapsed();
            }
            let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let Ok(mut tls) = connector.connect(name, tcp).await else {
                return opened.elapsed();
            };
            if i % 3 == 2 {
                let _ = tls
                    .write_all(b"GET /apis HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                    .await;
            }
            while matches!(tls.read(&mut buf).await, Ok(n) if n > 0) {}
            opened.elapsed()
        }));
    }
    // kubectl keeps working meanwhile.
    let kubectl = reports_server_tests::kubectl::Kubectl::new(&h.server.kubeconfig);
    let deadline = Instant::now() + TIMEOUT + Duration::from_secs(2);
    let mut calls = 0;
    while Instant::now() < deadline {
        let started = Instant::now();
        let out =
            tokio::task::block_in_place(|| kubectl.run(&["get", "polr", "-n", NS, "-o", "name"]))
                .expect("kubectl works while slow clients hold connections");
        assert!(out.contains("report-00000"), "{out}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "kubectl took {:?}",
            started.elapsed()
        );
        calls += 1;
    }
    let mut slowest = Duration::ZERO;
    for task in held {
        let closed_after = tokio::time::timeout(TIMEOUT * 5, task)
            .await
            .expect("every slow connection is closed")
            .unwrap();
        slowest = slowest.max(closed_after);
    }
    eprintln!(
        "[hostile] {CONNECTIONS} slow connections: the last closed after {slowest:?}; {calls} kubectl calls meanwhile"
    );
    assert!(
        // The timeout, the once-a-second check and at most five seconds to close.
        slowest <= TIMEOUT + Duration::from_secs(6),
        "closed after {slowest:?}"
    );
    h.assert_healthy("slow connections", &before).await;
}

#[tokio::test]
async fn requests_over_the_in_flight_cap_get_429_and_slow_bodies_504() {
    use tokio::io::AsyncReadExt;
    let h = Harness::start(&[
        "--max-mutating-requests-inflight",
        "1",
        "--request-timeout-seconds",
        "2",
    ])
    .await;
    let before = h.seeded().await;
    // One write holds the only mutating slot by sending its body slowly, so another write is
    // refused at once, with Retry-After.
    let (mut slow, _) = h.write_behind_a_slow_one(100, 1).await;
    // Reads have their own cap.
    assert_eq!(
        h.raw("GET", COLLECTION, "application/json", Vec::new())
            .await
            .0,
        200
    );
    // The slow write gets 504 at its deadline.
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), slow.read(&mut answer))
        .await
        .expect("the slow request is answered at its deadline")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    h.assert_healthy("in-flight", &before).await;
}

#[tokio::test]
async fn bodies_over_the_in_flight_byte_budget_get_429_until_the_budget_frees() {
    let budget = 1024 * 1024;
    let h = Harness::start(&[
        "--max-inflight-request-bytes",
        &budget.to_string(),
        "--max-request-bytes",
        &budget.to_string(),
    ])
    .await;
    let before = h.seeded().await;
    // A write sends all but the last byte of a budget-sized body and holds it there, so another
    // write's body does not fit: 429 with Retry-After, nothing stored.
    let (slow, body) = h.write_behind_a_slow_one(budget, budget - 1).await;
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-inflight-request-bytes")),
        "{body}"
    );
    // A request without a body takes nothing from it.
    assert_eq!(
        h.raw("GET", COLLECTION, "application/json", Vec::new())
            .await
            .0,
        200
    );
    // The held body ends (the connection closes): its share comes back and the write goes in.
    drop(slow);
    let mut stored = false;
    for _ in 0..50 {
        let (status, _) = h.post_report(9).await;
        if status == 201 {
            stored = true;
            break;
        }
        assert_eq!(status, 429, "only the budget may refuse it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(stored, "the budget came back after the held body ended");
    let refusals = h
        .metric("reports_server_apiserver_request_body_budget_refusals_total")
        .await;
    assert!(refusals >= 1.0, "{refusals}");
    h.assert_healthy("body budget", &before).await;
}

#[tokio::test]
async fn a_read_only_database_is_503_with_a_reason_and_without_the_driver_text() {
    let url = reports_server_tests::Backend::Postgres
        .database_url(std::path::Path::new("/"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let h = Harness::start_on(Some(url.clone()), &[]).await;
    let before = h.seeded().await;
    // The database turns read-only, as a standby does after a failover, and the server's
    // connections are cut so that new ones get the setting.
    let (admin, database) = url.rsplit_once('/').unwrap();
    let sql = format!(
        "ALTER DATABASE {database} SET default_transaction_read_only = on; \
         SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = '{database}' AND pid <> pg_backend_pid();"
    );
    let out = std::process::Command::new("psql")
        .args([
            &format!("{admin}/postgres"),
            "-v",
            "ON_ERROR_STOP=1",
            "-qc",
            &sql,
        ])
        .output()
        .expect("psql (apt-get install -y postgresql-client)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut messages = Vec::new();
    for n in 0..20 {
        let (status, body) = h
            .raw(
                "POST",
                COLLECTION,
                "application/json",
                serde_json::to_vec(&report(200 + n)).unwrap(),
            )
            .await;
        assert_eq!(status, 503, "{body}");
        let message = body["message"].as_str().unwrap_or_default().to_owned();
        assert!(
            !message.contains("cannot execute")
                && !message.contains("error returned from database"),
            "the driver's text reached the client: {message}"
        );
        messages.push(message);
        if messages.last().is_some_and(|m| m.contains("read-only")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        messages.iter().any(|m| m.contains("read-only")),
        "no write was refused as read-only: {messages:?}"
    );
    // Reads go on.
    h.assert_healthy("read-only database", &before).await;
}
