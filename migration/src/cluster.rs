//! The cluster side of a migration, through kube-apiserver: the CRD storage while a group's
//! APIService is still Local (lists, watches, reads), the write fence, and the APIServices.
//! Objects travel as raw JSON so that nothing a typed client does not know is lost on the way.

use std::collections::BTreeMap;

use futures::{Stream, StreamExt};
use http::Request;
use kube::core::WatchEvent;
use reports_server_crds::ResourceDescriptor;
use serde_json::{Value, json};

use super::MigrationError;
use super::plan::{self, FENCE_NAME, FENCE_PROBE_NAME, ObjectKey};

/// One page of a list.
pub struct Page {
    pub items: Vec<Value>,
    /// The list's resourceVersion (the etcd revision it was read at).
    pub resource_version: String,
    pub continue_token: Option<String>,
    /// How many objects follow this page (`metadata.remainingItemCount`), when the server says.
    pub remaining: Option<u64>,
}

/// kube-apiserver, as the migration uses it.
#[derive(Clone)]
pub struct Cluster {
    client: kube::Client,
}

fn collection_path(r: &ResourceDescriptor) -> String {
    format!("/apis/{}/{}/{}", r.group, r.version, r.plural)
}

fn object_path(r: &ResourceDescriptor, key: &ObjectKey) -> String {
    if r.namespaced {
        format!(
            "/apis/{}/{}/namespaces/{}/{}/{}",
            r.group, r.version, key.namespace, r.plural, key.name
        )
    } else {
        format!("{}/{}", collection_path(r), key.name)
    }
}

/// `resourceVersion` of a list as a number (etcd revisions and ours are both integers).
pub fn revision_of(list: &Value) -> Option<i64> {
    list["metadata"]["resourceVersion"].as_str()?.parse().ok()
}

impl Cluster {
    pub fn new(client: kube::Client) -> Self {
        Cluster { client }
    }

    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    async fn get_json(&self, path: &str) -> Result<Option<Value>, MigrationError> {
        let request = Request::get(path).body(Vec::new()).expect("valid request");
        match self.client.request::<Value>(request).await {
            Ok(v) => Ok(Some(v)),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
            Err(e) => Err(MigrationError::kube(format!("GET {path}"), e)),
        }
    }

    async fn send_json(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &Value,
    ) -> Result<Value, kube::Error> {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::CONTENT_TYPE, content_type)
            .body(serde_json::to_vec(body).expect("JSON values serialize"))
            .expect("valid request");
        self.client.request::<Value>(request).await
    }

    /// Whether the CRD of `r` is installed.
    pub async fn crd_exists(&self, r: &ResourceDescriptor) -> Result<bool, MigrationError> {
        let path = format!(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{}",
            r.crd_name()
        );
        Ok(self.get_json(&path).await?.is_some())
    }

    pub async fn apiservice(&self, name: &str) -> Result<Option<Value>, MigrationError> {
        self.get_json(&format!(
            "/apis/apiregistration.k8s.io/v1/apiservices/{name}"
        ))
        .await
    }

    pub async fn patch_apiservice(&self, name: &str, patch: &Value) -> Result<(), MigrationError> {
        let path = format!("/apis/apiregistration.k8s.io/v1/apiservices/{name}");
        self.send_json("PATCH", &path, "application/merge-patch+json", patch)
            .await
            .map_err(|e| MigrationError::kube(format!("PATCH {path}"), e))?;
        Ok(())
    }

    /// Whether kube-aggregator reports the APIService `Available`.
    pub async fn apiservice_available(&self, name: &str) -> Result<bool, MigrationError> {
        Ok(self.apiservice(name).await?.is_some_and(|a| {
            a["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Available" && c["status"] == "True")
            })
        }))
    }

    /// One page of every object of `r`, in all namespaces.
    pub async fn list_page(
        &self,
        r: &ResourceDescriptor,
        limit: u32,
        continue_token: Option<&str>,
    ) -> Result<Page, MigrationError> {
        let mut path = format!("{}?limit={limit}", collection_path(r));
        if let Some(token) = continue_token {
            path.push_str("&continue=");
            path.push_str(&urlencode(token));
        }
        let list = self.get_json(&path).await?.ok_or_else(|| {
            MigrationError::Source(format!("GET {path}: 404 (is the CRD installed?)"))
        })?;
        Ok(Page {
            remaining: list["metadata"]["remainingItemCount"].as_u64(),
            resource_version: list["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            continue_token: list["metadata"]["continue"]
                .as_str()
                .filter(|t| !t.is_empty())
                .map(str::to_owned),
            items: match list {
                Value::Object(mut m) => match m.remove("items") {
                    Some(Value::Array(items)) => items,
                    _ => Vec::new(),
                },
                _ => Vec::new(),
            },
        })
    }

    /// The key and resourceVersion of every object of `r` (metadata-only pages), and the
    /// revision the list was read at.
    pub async fn list_versions(
        &self,
        r: &ResourceDescriptor,
        limit: u32,
    ) -> Result<(BTreeMap<ObjectKey, String>, i64), MigrationError> {
        let mut out = BTreeMap::new();
        let mut token: Option<String> = None;
        let mut revision = 0;
        loop {
            let mut path = format!("{}?limit={limit}", collection_path(r));
            if let Some(t) = &token {
                path.push_str("&continue=");
                path.push_str(&urlencode(t));
            }
            let request = Request::get(&path)
                .header(
                    http::header::ACCEPT,
                    "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
                )
                .body(Vec::new())
                .expect("valid request");
            let list: Value = self
                .client
                .request(request)
                .await
                .map_err(|e| MigrationError::kube(format!("GET {path} (metadata)"), e))?;
            if token.is_none() {
                revision = revision_of(&list).unwrap_or(0);
            }
            for item in list["items"].as_array().into_iter().flatten() {
                out.insert(
                    ObjectKey::of(item),
                    item["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned(),
                );
            }
            token = list["metadata"]["continue"]
                .as_str()
                .filter(|t| !t.is_empty())
                .map(str::to_owned);
            if token.is_none() {
                return Ok((out, revision));
            }
        }
    }

    pub async fn get(
        &self,
        r: &ResourceDescriptor,
        key: &ObjectKey,
    ) -> Result<Option<Value>, MigrationError> {
        self.get_json(&object_path(r, key)).await
    }

    /// The resourceVersion of a one-item list of `r` as kube-apiserver answers it now: from etcd
    /// while the group is Local, from us once it is routed to us.
    pub async fn served_revision(
        &self,
        r: &ResourceDescriptor,
    ) -> Result<Option<i64>, MigrationError> {
        let path = format!("{}?limit=1", collection_path(r));
        let request = Request::get(&path).body(Vec::new()).expect("valid request");
        match self.client.request::<Value>(request).await {
            Ok(list) => Ok(revision_of(&list)),
            // Not routed yet, or routed to a server that is not up: not ours (yet).
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 503 => Ok(None),
            Err(e) => Err(MigrationError::kube(format!("GET {path}"), e)),
        }
    }

    /// Changes to `r` after `resource_version` (with bookmarks), until kube-apiserver ends the
    /// watch.
    pub async fn watch(
        &self,
        r: &ResourceDescriptor,
        resource_version: &str,
    ) -> Result<impl Stream<Item = Result<WatchEvent<Value>, kube::Error>> + use<>, MigrationError>
    {
        let path = format!(
            "{}?watch=1&allowWatchBookmarks=true&timeoutSeconds=290&resourceVersion={}",
            collection_path(r),
            urlencode(resource_version)
        );
        let request = Request::get(&path).body(Vec::new()).expect("valid request");
        let stream = self
            .client
            .request_events::<Value>(request)
            .await
            .map_err(|e| MigrationError::kube(format!("GET {path}"), e))?;
        Ok(stream.boxed())
    }

    /// Creates or replaces the fence (a ValidatingAdmissionPolicy and its binding).
    pub async fn apply_fence(&self, policy: &Value, binding: &Value) -> Result<(), MigrationError> {
        for (object, plural) in [
            (policy, "validatingadmissionpolicies"),
            (binding, "validatingadmissionpolicybindings"),
        ] {
            let path = format!(
                "/apis/admissionregistration.k8s.io/v1/{plural}/{FENCE_NAME}?fieldManager=reports-server-migration&force=true"
            );
            self.send_json("PATCH", &path, "application/apply-patch+yaml", object)
                .await
                .map_err(|e| MigrationError::kube(format!("apply {plural}/{FENCE_NAME}"), e))?;
        }
        Ok(())
    }

    pub async fn fence_exists(&self) -> Result<bool, MigrationError> {
        Ok(self
            .get_json(&format!(
                "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{FENCE_NAME}"
            ))
            .await?
            .is_some())
    }

    /// Deletes the probe CRD of `to-crds`; a missing one is fine.
    pub async fn remove_probe_crd(&self) -> Result<(), MigrationError> {
        self.delete_path(&format!(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{}.{}",
            plan::PROBE_PLURAL,
            plan::PROBE_GROUP
        ))
        .await
    }

    /// Removes the fence; a missing fence is fine.
    pub async fn remove_fence(&self) -> Result<(), MigrationError> {
        for plural in [
            "validatingadmissionpolicybindings",
            "validatingadmissionpolicies",
        ] {
            self.delete_path(&format!(
                "/apis/admissionregistration.k8s.io/v1/{plural}/{FENCE_NAME}"
            ))
            .await?;
        }
        Ok(())
    }

    /// Whether kube-apiserver refuses writes to `r` because of the fence: a dry-run create that
    /// the fence must deny.
    pub async fn fence_holds(&self, r: &ResourceDescriptor) -> Result<bool, MigrationError> {
        let mut probe = json!({
            "apiVersion": r.api_version(),
            "kind": r.kind,
            "metadata": {"name": FENCE_PROBE_NAME},
        });
        if r.namespaced {
            probe["metadata"]["namespace"] = json!("default");
        }
        let path = if r.namespaced {
            format!(
                "/apis/{}/{}/namespaces/default/{}",
                r.group, r.version, r.plural
            )
        } else {
            collection_path(r)
        };
        self.dry_run_refused_by_fence(&path, &probe).await
    }

    /// Whether the fence refuses a dry-run create of the probe kind ([`plan::probe_crd`]), which
    /// kube-apiserver serves whatever the report groups' APIServices say.
    pub async fn fence_holds_on_probe(&self) -> Result<bool, MigrationError> {
        let probe = json!({
            "apiVersion": format!("{}/v1", plan::PROBE_GROUP),
            "kind": plan::PROBE_KIND,
            "metadata": {"name": FENCE_PROBE_NAME},
        });
        let path = format!("/apis/{}/v1/{}", plan::PROBE_GROUP, plan::PROBE_PLURAL);
        self.dry_run_refused_by_fence(&path, &probe).await
    }

    async fn dry_run_refused_by_fence(
        &self,
        collection: &str,
        probe: &Value,
    ) -> Result<bool, MigrationError> {
        let path = format!("{collection}?dryRun=All");
        match self
            .send_json("POST", &path, "application/json", probe)
            .await
        {
            Err(kube::Error::Api(s)) if s.message.contains(FENCE_NAME) => Ok(true),
            Ok(_) | Err(kube::Error::Api(_)) => Ok(false),
            Err(e) => Err(MigrationError::kube(format!("POST {path} (dry run)"), e)),
        }
    }
}

impl Cluster {
    /// The user kube-apiserver sees for this client (a SelfSubjectReview).
    pub async fn username(&self) -> Result<String, MigrationError> {
        let review = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
        let path = "/apis/authentication.k8s.io/v1/selfsubjectreviews";
        let answer = self
            .send_json("POST", path, "application/json", &review)
            .await
            .map_err(|e| MigrationError::kube(format!("POST {path}"), e))?;
        answer["status"]["userInfo"]["username"]
            .as_str()
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| MigrationError::Source(format!("{path} named no user: {answer}")))
    }

    /// Creates or updates CRDs (server-side apply) and waits until each is Established.
    pub async fn apply_crds(
        &self,
        crds: &[Value],
        timeout: std::time::Duration,
    ) -> Result<(), MigrationError> {
        let deadline = std::time::Instant::now() + timeout;
        for crd in crds {
            let name = crd["metadata"]["name"].as_str().unwrap_or_default();
            // A CRD still being deleted (an earlier run's probe CRD) would accept the apply and
            // stay Established while refusing every create: wait until it is gone.
            let get = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
            while self
                .get_json(&get)
                .await?
                .is_some_and(|c| c["metadata"]["deletionTimestamp"].is_string())
            {
                if std::time::Instant::now() > deadline {
                    return Err(MigrationError::Timeout(format!(
                        "CRD {name} is still being deleted after {timeout:?}"
                    )));
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            let path = format!(
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}?fieldManager=reports-server-migration&force=true"
            );
            self.send_json("PATCH", &path, "application/apply-patch+yaml", crd)
                .await
                .map_err(|e| MigrationError::kube(format!("apply CRD {name}"), e))?;
        }
        for crd in crds {
            let name = crd["metadata"]["name"].as_str().unwrap_or_default();
            let path = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
            loop {
                let established = self.get_json(&path).await?.is_some_and(|c| {
                    c["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == "Established" && c["status"] == "True")
                    })
                });
                if established {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    return Err(MigrationError::Timeout(format!(
                        "CRD {name} not Established within {timeout:?}"
                    )));
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    /// Ends every watch kube-apiserver serves from the CRD storage of `r`. Watches opened before
    /// a switch stay connected to the CRD handler (kube-apiserver routes only new requests to
    /// us) and would see nothing until they time out; a change of the CRD's spec makes
    /// kube-apiserver rebuild that storage and close them, and the clients watch again — against
    /// us, with an etcd revision that gets 410, so they relist. The spec change is a category
    /// added and removed again.
    pub async fn end_crd_watches(&self, r: &ResourceDescriptor) -> Result<(), MigrationError> {
        let path = format!(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{}",
            r.crd_name()
        );
        let Some(crd) = self.get_json(&path).await? else {
            return Ok(());
        };
        let original = crd["spec"]["names"]["categories"].clone();
        let mut marked: Vec<Value> = original.as_array().cloned().unwrap_or_default();
        marked.push(json!("reports-server-switching"));
        for categories in [Value::Array(marked), original] {
            let patch = json!({"spec": {"names": {"categories": categories}}});
            self.send_json("PATCH", &path, "application/merge-patch+json", &patch)
                .await
                .map_err(|e| MigrationError::kube(format!("PATCH {path}"), e))?;
        }
        Ok(())
    }

    /// Every object of `r`, whole, by key.
    pub async fn list_objects(
        &self,
        r: &ResourceDescriptor,
        limit: u32,
    ) -> Result<BTreeMap<ObjectKey, Value>, MigrationError> {
        let mut out = BTreeMap::new();
        let mut token: Option<String> = None;
        loop {
            let page = self.list_page(r, limit, token.as_deref()).await?;
            for item in page.items {
                out.insert(ObjectKey::of(&item), item);
            }
            token = page.continue_token;
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// Creates `object` (its metadata carries namespace and name).
    pub async fn create(
        &self,
        r: &ResourceDescriptor,
        object: &Value,
    ) -> Result<(), MigrationError> {
        let key = ObjectKey::of(object);
        let path = if r.namespaced {
            format!(
                "/apis/{}/{}/namespaces/{}/{}",
                r.group, r.version, key.namespace, r.plural
            )
        } else {
            collection_path(r)
        };
        self.send_json("POST", &path, "application/json", object)
            .await
            .map_err(|e| MigrationError::kube(format!("POST {path} ({key})"), e))?;
        Ok(())
    }

    /// Replaces the object at `object`'s key; `object` carries the resourceVersion to replace.
    pub async fn replace(
        &self,
        r: &ResourceDescriptor,
        object: &Value,
    ) -> Result<(), MigrationError> {
        let path = object_path(r, &ObjectKey::of(object));
        self.send_json("PUT", &path, "application/json", object)
            .await
            .map_err(|e| MigrationError::kube(format!("PUT {path}"), e))?;
        Ok(())
    }

    /// Deletes the object at `key`; a missing one is fine.
    pub async fn delete(
        &self,
        r: &ResourceDescriptor,
        key: &ObjectKey,
    ) -> Result<(), MigrationError> {
        self.delete_path(&object_path(r, key)).await
    }

    /// `DELETE path`; a missing object is fine.
    async fn delete_path(&self, path: &str) -> Result<(), MigrationError> {
        let request = Request::delete(path)
            .body(Vec::new())
            .expect("valid request");
        match self.client.request::<Value>(request).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(MigrationError::kube(format!("DELETE {path}"), e)),
        }
    }
}

/// Percent-encodes a query parameter value (continue tokens are base64 with `=` and `/`).
fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(urlencode("eyJ2Ijo=/+"), "eyJ2Ijo%3D%2F%2B");
        assert_eq!(urlencode("123"), "123");
    }

    #[test]
    fn paths_follow_the_scope() {
        let key = ObjectKey {
            namespace: "ns".into(),
            name: "n".into(),
        };
        assert_eq!(
            object_path(&reports_server_crds::catalog::POLICY_REPORT, &key),
            "/apis/wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/n"
        );
        let key = ObjectKey {
            namespace: String::new(),
            name: "n".into(),
        };
        assert_eq!(
            object_path(&reports_server_crds::catalog::CLUSTER_POLICY_REPORT, &key),
            "/apis/wgpolicyk8s.io/v1alpha2/clusterpolicyreports/n"
        );
    }
}
