//! The real server process, driven by the kube-rs client over HTTPS, on SQLite and PostgreSQL:
//! conflicts, malformed input, pagination over 10,000 realistic reports, restarts and watches
//! that resume from an old resourceVersion.

use std::collections::HashSet;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::Backend;
use reports_server_tests::objects::api_error;
use reports_server_tests::server::ServerProcess;
use serde_json::json;

async fn start(backend: Backend, dir: &std::path::Path) -> ServerProcess {
    let url = backend
        .database_url(dir)
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    ServerProcess::start(dir, Some(url))
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"))
}

fn report(ns: &str, n: u64) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(ns, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(format!("report-{n:05}"));
    r
}

async fn raw(
    client: &kube::Client,
    method: &str,
    uri: &str,
    content_type: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let request = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", content_type)
        .body(body.as_bytes().to_vec())
        .unwrap();
    let response = client
        .send(request.map(kube::client::Body::from))
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(json!(null)),
    )
}

#[tokio::test]
async fn conflicts_and_bad_input_change_nothing() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let api: Api<PolicyReport> = Api::namespaced(client.clone(), "team-a");
        let created = api
            .create(&PostParams::default(), &report("team-a", 1))
            .await
            .unwrap();
        let rv = created.metadata.resource_version.clone().unwrap();
        assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
        assert_eq!(created.metadata.generation, Some(1));

        // Duplicate create: 409 AlreadyExists, original untouched.
        let mut dup = report("team-a", 1);
        dup.summary.as_mut().unwrap().pass = Some(999);
        assert_eq!(
            api_error(api.create(&PostParams::default(), &dup).await.unwrap_err()),
            (409, "AlreadyExists".into()),
            "{backend:?}"
        );
        let now = api.get("report-00001").await.unwrap();
        assert_eq!(now.metadata.resource_version.as_deref(), Some(rv.as_str()));
        assert_eq!(now.summary, created.summary);

        // Update with the current resourceVersion works and bumps generation; a stale one is 409.
        let mut update = now.clone();
        update.summary.as_mut().unwrap().pass = Some(3);
        let updated = api
            .replace("report-00001", &PostParams::default(), &update)
            .await
            .unwrap();
        assert_eq!(updated.metadata.generation, Some(2));
        let mut stale = now.clone();
        stale.summary.as_mut().unwrap().pass = Some(1);
        assert_eq!(
            api_error(
                api.replace("report-00001", &PostParams::default(), &stale)
                    .await
                    .unwrap_err()
            ),
            (409, "Conflict".into())
        );
        // Update of something missing: 404.
        let mut missing = now.clone();
        missing.metadata.name = Some("nope".into());
        assert_eq!(
            api_error(
                api.replace("nope", &PostParams::default(), &missing)
                    .await
                    .unwrap_err()
            )
            .0,
            404
        );

        // Malformed JSON: 400. Schema violation: 422 naming the field. Nothing written.
        let before = api.list(&ListParams::default()).await.unwrap();
        let path = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-a/policyreports";
        let (code, status) = raw(
            &client,
            "POST",
            path,
            "application/json",
            "{\"metadata\": {\"name\": \"x\"",
        )
        .await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (400, Some("BadRequest")),
            "{status}"
        );
        let (code, status) = raw(
            &client,
            "POST",
            path,
            "application/json",
            r#"{"metadata":{"name":"x"},"results":[{"policy":"p","result":"maybe"}]}"#,
        )
        .await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (422, Some("Invalid")),
            "{status}"
        );
        assert_eq!(status["details"]["causes"][0]["field"], "results[0].result");
        let (code, _) = raw(
            &client,
            "POST",
            path,
            "application/json",
            r#"{"metadata":{"name":"UPPER"}}"#,
        )
        .await;
        assert_eq!(code, 422);
        let (code, status) = raw(
            &client,
            "PATCH",
            &format!("{path}/report-00001"),
            "application/strategic-merge-patch+json",
            "{}",
        )
        .await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (415, Some("UnsupportedMediaType"))
        );
        let after = api.list(&ListParams::default()).await.unwrap();
        assert_eq!(after.items.len(), before.items.len(), "{backend:?}");
        assert_eq!(
            after.metadata.resource_version, before.metadata.resource_version,
            "{backend:?}: a rejected write must not bump the resourceVersion"
        );

        // Merge and JSON patches; a patch carrying a stale resourceVersion is 409.
        let patched = api
            .patch(
                "report-00001",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
            )
            .await
            .unwrap();
        assert_eq!(patched.metadata.labels.unwrap()["team"], "a");
        assert_eq!(
            patched.metadata.generation,
            Some(2),
            "a metadata-only change keeps the generation"
        );
        let json_patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "replace", "path": "/summary/fail", "value": 5}]))
                .unwrap();
        let patched = api
            .patch(
                "report-00001",
                &PatchParams::default(),
                &Patch::<()>::Json(json_patch),
            )
            .await
            .unwrap();
        assert_eq!(patched.summary.unwrap().fail, Some(5));
        let stale_patch =
            Patch::Merge(json!({"metadata": {"resourceVersion": rv}, "summary": {"fail": 0}}));
        assert_eq!(
            api_error(
                api.patch("report-00001", &PatchParams::default(), &stale_patch)
                    .await
                    .unwrap_err()
            )
            .0,
            409
        );

        // generateName.
        let mut generated = report("team-a", 2);
        generated.metadata.name = None;
        generated.metadata.generate_name = Some("gen-".into());
        let g = api
            .create(&PostParams::default(), &generated)
            .await
            .unwrap();
        assert!(g.metadata.name.unwrap().starts_with("gen-"));

        // Delete, then 404.
        api.delete("report-00001", &DeleteParams::default())
            .await
            .unwrap();
        assert_eq!(api_error(api.get("report-00001").await.unwrap_err()).0, 404);
        assert_eq!(
            api_error(
                api.delete("report-00001", &DeleteParams::default())
                    .await
                    .unwrap_err()
            )
            .0,
            404
        );
    }
}

#[tokio::test]
async fn ten_thousand_reports_page_exactly_once() {
    // Not yet on MariaDB: a first run with it had not finished this test after 9 minutes on 2
    // shared cores (MySQL writes each object with statements of its own, no multi-row rounds);
    // to be measured before it joins.
    for backend in Backend::SQLITE_AND_POSTGRES {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let total = 10_000u64;
        futures::stream::iter(0..total)
            .map(|n| {
                let ns = format!("ns-{}", n % 20);
                let api: Api<PolicyReport> = Api::namespaced(client.clone(), &ns);
                async move { api.create(&PostParams::default(), &report(&ns, n)).await }
            })
            .buffer_unordered(16)
            .try_collect::<Vec<_>>()
            .await
            .unwrap();
        let api: Api<PolicyReport> = Api::all(client.clone());
        let mut seen = HashSet::new();
        let mut params = ListParams::default().limit(500);
        let mut pages = 0;
        let mut first_rv = None;
        loop {
            let page = api.list(&params).await.unwrap();
            pages += 1;
            assert!(page.items.len() <= 500);
            first_rv.get_or_insert(page.metadata.resource_version.clone());
            assert_eq!(
                Some(page.metadata.resource_version.clone()),
                first_rv,
                "every page is stamped with the first page's resourceVersion"
            );
            for item in page.items {
                assert!(
                    seen.insert((
                        item.metadata.namespace.unwrap(),
                        item.metadata.name.unwrap()
                    )),
                    "{backend:?}: duplicate in pagination"
                );
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => params = params.continue_token(&c),
                None => break,
            }
        }
        assert_eq!(seen.len() as u64, total, "{backend:?}");
        assert_eq!(pages, 20, "{backend:?}");
        // A token replayed with another selector is refused.
        let first = api.list(&ListParams::default().limit(10)).await.unwrap();
        let token = first.metadata.continue_.unwrap();
        let err = api
            .list(
                &ListParams::default()
                    .limit(10)
                    .labels("x=y")
                    .continue_token(&token),
            )
            .await
            .unwrap_err();
        assert_eq!(api_error(err).0, 400);
    }
}

#[tokio::test]
async fn data_and_versions_survive_restart_and_watch_resumes() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let mut server = start(backend, dir.path()).await;
        let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), "ns");
        for n in 0..5 {
            api.create(&PostParams::default(), &report("ns", n))
                .await
                .unwrap();
        }
        let list = api.list(&ListParams::default()).await.unwrap();
        let old_rv = list.metadata.resource_version.clone().unwrap();
        api.delete("report-00000", &DeleteParams::default())
            .await
            .unwrap();
        api.create(&PostParams::default(), &report("ns", 5))
            .await
            .unwrap();

        server.restart().await.unwrap();
        let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), "ns");
        let list = api.list(&ListParams::default()).await.unwrap();
        let names: Vec<String> = list
            .items
            .iter()
            .map(|r| r.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "report-00001",
                "report-00002",
                "report-00003",
                "report-00004",
                "report-00005"
            ],
            "{backend:?}"
        );
        assert!(
            list.metadata
                .resource_version
                .unwrap()
                .parse::<i64>()
                .unwrap()
                > old_rv.parse::<i64>().unwrap()
        );

        // Watch from the resourceVersion seen before the restart: the two later changes arrive.
        let mut events = api
            .watch(&WatchParams::default().timeout(10), &old_rv)
            .await
            .unwrap()
            .boxed();
        let mut got = Vec::new();
        while got.len() < 2 {
            match tokio::time::timeout(Duration::from_secs(10), events.try_next())
                .await
                .expect("watch stalled")
                .unwrap()
            {
                Some(WatchEvent::Deleted(r)) => {
                    got.push(format!("DELETED {}", r.metadata.name.unwrap()))
                }
                Some(WatchEvent::Added(r)) => {
                    got.push(format!("ADDED {}", r.metadata.name.unwrap()))
                }
                Some(other) => panic!("unexpected event {other:?}"),
                None => break,
            }
        }
        assert_eq!(
            got,
            ["DELETED report-00000", "ADDED report-00005"],
            "{backend:?}"
        );

        // A live event after the restart reaches the same watch.
        api.create(&PostParams::default(), &report("ns", 6))
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_secs(10), events.try_next())
            .await
            .expect("live event")
            .unwrap()
        {
            Some(WatchEvent::Added(r)) => {
                assert_eq!(r.metadata.name.as_deref(), Some("report-00006"))
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn watch_from_a_compacted_version_is_410() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start_with(
        dir.path(),
        None,
        &[
            "--watch-history-max-events",
            "3",
            "--compaction-interval-seconds",
            "1",
        ],
    )
    .await
    .unwrap();
    let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), "ns");
    for n in 0..10 {
        api.create(&PostParams::default(), &report("ns", n))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut events = api
        .watch(&WatchParams::default().timeout(5), "1")
        .await
        .unwrap()
        .boxed();
    match events.try_next().await.unwrap() {
        Some(WatchEvent::Error(e)) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
}

#[tokio::test]
async fn label_selector_watch_sees_only_matching_namespace_and_labels() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), None).await.unwrap();
    let client = server.client().await.unwrap();
    let a: Api<PolicyReport> = Api::namespaced(client.clone(), "a");
    let b: Api<PolicyReport> = Api::namespaced(client.clone(), "b");
    let rv = a
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut events = a
        .watch(&WatchParams::default().labels("team=x").timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    let mut labelled = report("a", 1);
    labelled
        .metadata
        .labels
        .get_or_insert_default()
        .insert("team".into(), "x".into());
    let mut in_b = labelled.clone();
    in_b.metadata.namespace = Some("b".into());
    b.create(&PostParams::default(), &in_b).await.unwrap();
    a.create(&PostParams::default(), &report("a", 2))
        .await
        .unwrap();
    a.create(&PostParams::default(), &labelled).await.unwrap();
    // Removing the label turns into DELETED for this watcher.
    a.patch(
        "report-00001",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"team": null}}})),
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(10), events.try_next())
            .await
            .expect("watch stalled")
            .unwrap()
        {
            Some(WatchEvent::Added(r)) => got.push(format!(
                "ADDED {}/{}",
                r.metadata.namespace.unwrap(),
                r.metadata.name.unwrap()
            )),
            Some(WatchEvent::Deleted(r)) => got.push(format!(
                "DELETED {}/{}",
                r.metadata.namespace.unwrap(),
                r.metadata.name.unwrap()
            )),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, ["ADDED a/report-00001", "DELETED a/report-00001"]);
}

/// Regression (a real Kyverno on a fresh install): an empty server answered lists with
/// `metadata.resourceVersion: "0"`. client-go's RetryWatcher, which every Kyverno controller
/// starts from a list's resourceVersion, refuses "0" and "", so the controllers looped forever
/// and never wrote a report. On a fresh server every list names a version above 0, and a watch
/// started from it (as a RetryWatcher does) sees the first write.
#[tokio::test]
async fn a_fresh_server_never_answers_resource_version_zero() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let server = start(backend, dir.path()).await;
        let client = server.client().await.unwrap();
        let mut versions = Vec::new();
        for desc in reports_server_crds::catalog::ALL {
            let uri = format!("/apis/{}/{}/{}", desc.group, desc.version, desc.plural);
            let (status, list) = raw(&client, "GET", &uri, "application/json", "").await;
            assert_eq!(status, 200, "{backend:?} GET {uri}: {list}");
            assert_eq!(list["items"], json!([]), "{backend:?} {uri}");
            let rv = list["metadata"]["resourceVersion"].as_str().unwrap_or("");
            assert!(
                rv.parse::<u64>().is_ok_and(|n| n > 0),
                "{backend:?} {uri}: resourceVersion {rv:?} (client-go refuses \"0\" and \"\")"
            );
            versions.push(rv.to_owned());
        }
        // One counter for every kind: all lists name the same version.
        assert!(versions.windows(2).all(|w| w[0] == w[1]), "{versions:?}");

        let api: Api<PolicyReport> = Api::namespaced(client, "ns");
        let mut events = api
            .watch(&WatchParams::default().timeout(10), &versions[0])
            .await
            .unwrap()
            .boxed();
        let created = api
            .create(&PostParams::default(), &report("ns", 1))
            .await
            .unwrap();
        match events.try_next().await.unwrap() {
            Some(WatchEvent::Added(o)) => {
                assert_eq!(o.metadata.name, created.metadata.name, "{backend:?}");
                let rv: u64 = o.metadata.resource_version.unwrap().parse().unwrap();
                assert!(rv > versions[0].parse().unwrap(), "{backend:?}");
            }
            other => panic!("{backend:?}: expected ADDED from the list's version, got {other:?}"),
        }
    }
}
