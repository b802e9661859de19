//! The `DatabaseAvailable` condition: whether an installation's servers reach their database,
//! as the servers themselves see it.
//!
//! Why not readiness: a server whose database is down stays Ready on purpose (an emptied
//! Service would take three API groups out of the cluster's discovery), so neither the pods nor
//! the APIServices tell that data requests are being refused. Why not `Degraded`: that means
//! "needs the user", and an outage usually ends by itself. Why ask the servers rather than the
//! database: only they know whether *they* reach it (network policies, DNS, credentials, a
//! proxy in front of a failover); each says so on `/readyz?verbose`, which answers anyone, as the
//! kubelet's probes do. The operator asks every server endpoint, with the CA and server name
//! kube-apiserver itself uses for the APIServices, every `--database-check-interval-seconds`,
//! and triggers a reconcile only when the answer differs from the condition on the object.
//!
//! [`parse_readyz`] and [`summarize`] are pure; [`observe`] and [`run`] do the I/O.

use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use reports_server_crds::catalog::GROUP_VERSIONS;
use reports_server_crds::reportsserver::ReportsServer;
use tokio_util::sync::CancellationToken;

use crate::controller::Context;

/// How long one server endpoint may take to answer `/readyz?verbose`.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// What one server said of its database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerView {
    Answers,
    NoAnswer,
    ReadOnly,
}

/// The server's database line in a `/readyz?verbose` body (`None`: a body without one, such
/// as an older server's).
pub fn parse_readyz(body: &str) -> Option<ServerView> {
    let line = body
        .lines()
        .find(|l| l.starts_with("[+]database") || l.starts_with("[-]database"))?;
    Some(if line.starts_with("[+]") {
        ServerView::Answers
    } else if line.contains("read-only") {
        ServerView::ReadOnly
    } else {
        ServerView::NoAnswer
    })
}

/// The condition's content: `status` is `None` for Unknown. No durations in the message: it
/// would change at every check, and `lastTransitionTime` already tells since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub status: Option<bool>,
    pub reason: String,
    pub message: String,
}

impl Observation {
    fn unknown(reason: &str, message: impl Into<String>) -> Self {
        Observation {
            status: None,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// Before the first check of an installation.
    pub fn not_checked_yet() -> Self {
        Self::unknown("NotCheckedYet", "the servers have not been asked yet")
    }

    /// `True`/`False`/`Unknown`, as a condition's status.
    pub fn status_text(&self) -> &'static str {
        match self.status {
            Some(true) => "True",
            Some(false) => "False",
            None => "Unknown",
        }
    }
}

/// One condition from what every server endpoint answered (its address, and its view or why
/// it gave none).
pub fn summarize(answers: &[(String, Result<ServerView, String>)]) -> Observation {
    if answers.is_empty() {
        return Observation::unknown("NoServerEndpoints", "no server pod is an endpoint yet");
    }
    let views: Vec<ServerView> = answers.iter().filter_map(|(_, a)| a.clone().ok()).collect();
    if views.is_empty() {
        let (address, why) = &answers[0];
        let why = why.as_ref().err().cloned().unwrap_or_default();
        return Observation::unknown(
            "ServersDidNotAnswer",
            format!("no server pod answered /readyz?verbose (e.g. {address}: {why})"),
        );
    }
    let count = |view| views.iter().filter(|v| **v == view).count();
    let (read_only, no_answer) = (count(ServerView::ReadOnly), count(ServerView::NoAnswer));
    let of = format!("of {} server pods", views.len());
    let (reason, message) = if read_only > 0 {
        (
            "DatabaseReadOnly",
            format!(
                "{read_only} {of}: the database answers read-only (a standby: a failover or \
                 switchover is under way); data requests answer 503 until a writable primary answers"
            ),
        )
    } else if no_answer > 0 {
        (
            "DatabaseUnreachable",
            format!(
                "{no_answer} {of}: the database does not answer; data requests answer 503 until \
                 it does (discovery is not affected; see the servers' logs for the cause)"
            ),
        )
    } else {
        return Observation {
            status: Some(true),
            reason: "DatabaseAnswers".into(),
            message: format!("every server pod ({}) reaches the database", views.len()),
        };
    };
    Observation {
        status: Some(false),
        reason: reason.into(),
        message,
    }
}

/// Asks every endpoint of `rs`'s Service what its server sees of the database.
pub async fn observe(client: &Client, rs: &ReportsServer) -> Observation {
    if rs.spec.external.is_some() {
        return Observation::unknown(
            "External",
            "the server runs outside the cluster; its reports_server_database_up metric tells",
        );
    }
    let ns = rs.namespace().unwrap_or_default();
    let Some((server_name, ca)) = serving_identity(client, rs).await else {
        return Observation::unknown("NoAPIService", "no APIService of this installation yet");
    };
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let selector = format!(
        "kubernetes.io/service-name={}",
        crate::desired::service_name(rs)
    );
    let slices = match slices.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list.items,
        Err(e) => {
            return Observation::unknown(
                "EndpointsUnreadable",
                format!("list EndpointSlices: {e}"),
            );
        }
    };
    let mut answers = Vec::new();
    for (address, port) in endpoints(&slices) {
        let answer = ask(&address, port, &server_name, &ca).await;
        answers.push((address, answer));
    }
    summarize(&answers)
}

/// The name kube-apiserver verifies the servers' certificate against and the CA bundle it
/// trusts, from the first of the installation's APIServices that has both.
async fn serving_identity(client: &Client, rs: &ReportsServer) -> Option<(String, Vec<u8>)> {
    let api: Api<APIService> = Api::all(client.clone());
    for (group, version) in GROUP_VERSIONS {
        if !rs.spec.enabled_groups().contains(&(version, group)) {
            continue;
        }
        let Ok(Some(found)) = api.get_opt(&format!("{version}.{group}")).await else {
            continue;
        };
        let Some(spec) = found.spec else {
            continue;
        };
        if let (Some(service), Some(ca)) = (spec.service, spec.ca_bundle) {
            let name = format!(
                "{}.{}.svc",
                service.name.unwrap_or_default(),
                service.namespace.unwrap_or_default()
            );
            return Some((name, ca.0));
        }
    }
    None
}

/// Ready endpoint addresses with their port.
fn endpoints(slices: &[EndpointSlice]) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for slice in slices {
        let Some(port) = slice
            .ports
            .iter()
            .flatten()
            .find_map(|p| p.port.and_then(|p| u16::try_from(p).ok()))
        else {
            continue;
        };
        for endpoint in slice.endpoints.iter().flatten() {
            let ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            if ready {
                out.extend(endpoint.addresses.iter().map(|a| (a.clone(), port)));
            }
        }
    }
    out
}

/// `GET /readyz?verbose` on one server, anonymously, verifying its certificate as
/// kube-apiserver does.
async fn ask(
    address: &str,
    port: u16,
    server_name: &str,
    ca_pem: &[u8],
) -> Result<ServerView, String> {
    let host = if address.contains(':') {
        format!("[{address}]")
    } else {
        address.to_owned()
    };
    let url: http::Uri = format!("https://{host}:{port}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut config = kube::Config::new(url);
    config.root_cert = Some(
        x509_parser::pem::Pem::iter_from_buffer(ca_pem)
            .filter_map(Result::ok)
            .map(|pem| pem.contents)
            .collect(),
    );
    config.tls_server_name = Some(server_name.to_owned());
    config.connect_timeout = Some(ASK_TIMEOUT);
    config.read_timeout = Some(ASK_TIMEOUT);
    let client = Client::try_from(config).map_err(|e| e.to_string())?;
    let request = http::Request::get("/readyz?verbose")
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let body = tokio::time::timeout(ASK_TIMEOUT, client.request_text(request))
        .await
        .map_err(|_| format!("no answer within {ASK_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    parse_readyz(&body).ok_or_else(|| "no database line in /readyz?verbose".into())
}

/// Checks every known installation every `interval` until `stop`, keeping the answers in
/// `ctx` and asking for a reconcile when an installation's condition is out of date (rarely:
/// at the start and end of outages, so reconciling every installation then costs little).
pub async fn run(
    ctx: Arc<Context>,
    installations: Store<ReportsServer>,
    reconcile: UnboundedSender<()>,
    stop: CancellationToken,
) {
    let interval = ctx.config.database_check_interval;
    loop {
        let mut stale = false;
        for rs in installations.state() {
            if rs.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let seen = observe(&ctx.client, &rs).await;
            if !crate::status::shows_database(&rs, &seen) {
                tracing::info!(name = %rs.name_any(), status = seen.status_text(),
                    reason = seen.reason, message = seen.message, "the servers' view of the database changed");
                stale = true;
            }
            ctx.record_database(ObjectRef::from_obj(&*rs), seen);
        }
        if stale {
            reconcile.unbounded_send(()).ok();
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str =
        "[+]ping ok\n[+]shutdown ok\n[+]database ok (informational)\nreadyz check passed\n";
    const DOWN: &str = "[+]ping ok\n[+]shutdown ok\n[-]database: no answer for 12s, see the server's log (informational: data requests answer 503)\nreadyz check passed\n";
    const READ_ONLY: &str = "[+]ping ok\n[-]database: read-only for 3s, see the server's log\n";

    #[test]
    fn the_database_line_is_read() {
        assert_eq!(parse_readyz(OK), Some(ServerView::Answers));
        assert_eq!(parse_readyz(DOWN), Some(ServerView::NoAnswer));
        assert_eq!(parse_readyz(READ_ONLY), Some(ServerView::ReadOnly));
        assert_eq!(parse_readyz("ok"), None);
    }

    fn answer(view: ServerView) -> (String, Result<ServerView, String>) {
        ("10.0.0.1".into(), Ok(view))
    }

    #[test]
    fn one_server_without_its_database_makes_the_condition_false() {
        let all = summarize(&[answer(ServerView::Answers), answer(ServerView::Answers)]);
        assert_eq!(
            (all.status, all.reason.as_str()),
            (Some(true), "DatabaseAnswers")
        );
        let one = summarize(&[answer(ServerView::Answers), answer(ServerView::NoAnswer)]);
        assert_eq!(
            (one.status, one.reason.as_str()),
            (Some(false), "DatabaseUnreachable")
        );
        assert!(
            one.message.starts_with("1 of 2 server pods"),
            "{}",
            one.message
        );
        let ro = summarize(&[answer(ServerView::ReadOnly), answer(ServerView::NoAnswer)]);
        assert_eq!(
            ro.reason, "DatabaseReadOnly",
            "read-only names the failover"
        );
    }

    #[test]
    fn silence_is_unknown_not_false() {
        assert_eq!(summarize(&[]).status, None);
        let silent = summarize(&[("10.0.0.2".into(), Err("connection refused".into()))]);
        assert_eq!(
            (silent.status, silent.reason.as_str()),
            (None, "ServersDidNotAnswer")
        );
        assert!(silent.message.contains("10.0.0.2: connection refused"));
        let some = summarize(&[
            ("10.0.0.2".into(), Err("timeout".into())),
            answer(ServerView::Answers),
        ]);
        assert_eq!(some.status, Some(true), "the servers that answered decide");
    }

    #[test]
    fn the_message_does_not_change_while_the_outage_lasts() {
        let early = summarize(&[answer(parse_readyz(DOWN).unwrap())]);
        let later = summarize(&[answer(parse_readyz(&DOWN.replace("12s", "95s")).unwrap())]);
        assert_eq!(early, later);
    }
}
