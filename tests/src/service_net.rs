//! The cluster's Service network for the node tests, without kube-proxy or CoreDNS.
//!
//! Pods of an installation reach one another the way they do in a real cluster: by the DNS
//! name of a Service (`<svc>.<ns>.svc`, through the resolv.conf search list the kubelet writes)
//! and its ClusterIP. kube-proxy would program iptables and CoreDNS would answer the names; both
//! are large, and kube-proxy also wants machine-wide conntrack settings. Inside the node's
//! private network namespace this module does the same in user space:
//!
//! * **DNS** on the node IP, port 53 (the kubelet's `clusterDNS`): an `A` query for
//!   `<svc>.<ns>.svc.<cluster domain>` answers the Service's ClusterIP, or the ready endpoint
//!   addresses of a headless Service; any other name is `NXDOMAIN` (pods need no names outside
//!   the cluster here), other record types of a known name are answered empty.
//! * **ClusterIPs**: each `ClusterIP:port` (TCP) is added to the namespace's `lo` and forwarded,
//!   connection by connection, to a ready endpoint of the Service (round robin over the
//!   EndpointSlices' ready addresses, the port matched by name as kube-proxy does).
//!
//! Both run on a runtime of their own thread ([`spawn_on_own_runtime`]).

use std::{
    collections::{HashMap, HashSet},
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};

/// TTL of DNS answers: short, because endpoints of headless Services move with their pods.
const DNS_TTL_SECONDS: u32 = 5;
/// How long a forwarded connection waits for an endpoint to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A future running on a current-thread runtime of its own thread, stopped when dropped. The
/// harness' network stand-ins run like this because the test's runtime blocks for seconds on
/// synchronous `kubectl` calls, and pods whose traffic stalled behind them would fail their
/// probes.
pub struct OwnRuntime {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Runs the future `make` returns (built inside the new runtime, so it may register sockets)
/// on a thread named `name` until it ends or the returned guard is dropped.
pub fn spawn_on_own_runtime<F, Fut>(name: &str, make: F) -> Result<OwnRuntime>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            rt.block_on(async move {
                tokio::select! {
                    _ = make() => {}
                    _ = stop_rx => {}
                }
            });
        })?;
    Ok(OwnRuntime {
        stop: Some(stop_tx),
    })
}

/// Stops the DNS server and the forwarders when dropped.
pub struct ServiceNet {
    _runtime: OwnRuntime,
}

impl ServiceNet {
    /// Serves DNS on `dns_ip:53` and forwards every ClusterIP the API server allocates, except
    /// the `(ip, port)` pairs in `already_served` (the harness forwards the `kubernetes` Service
    /// itself). Must run inside the node's network namespace: it adds addresses to `lo`.
    pub fn start(
        kubeconfig: &Path,
        dns_ip: Ipv4Addr,
        cluster_domain: &str,
        already_served: &[(Ipv4Addr, u16)],
    ) -> Result<ServiceNet> {
        let dns = std::net::UdpSocket::bind((dns_ip, 53))
            .with_context(|| format!("binding the cluster DNS server to {dns_ip}:53"))?;
        dns.set_nonblocking(true)?;
        let kubeconfig = kubeconfig.to_path_buf();
        let suffix = format!(".svc.{cluster_domain}");
        let bound: HashSet<(Ipv4Addr, u16)> = already_served.iter().copied().collect();
        let runtime = spawn_on_own_runtime("service-net", move || async move {
            if let Err(e) = serve(&kubeconfig, dns, suffix, bound).await {
                eprintln!("[service-net] stopped: {e:#}");
            }
        })?;
        Ok(ServiceNet { _runtime: runtime })
    }
}

async fn serve(
    kubeconfig: &Path,
    dns: std::net::UdpSocket,
    suffix: String,
    bound: HashSet<(Ipv4Addr, u16)>,
) -> Result<()> {
    let client = crate::controlplane::kube_client_for(kubeconfig).await?;
    let (services, services_writer) = reflector::store::<Service>();
    let (slices, slices_writer) = reflector::store::<EndpointSlice>();
    let slice_events = watcher(
        Api::<EndpointSlice>::all(client.clone()),
        Default::default(),
    )
    .default_backoff()
    .reflect(slices_writer)
    .for_each(|_| async {});
    tokio::spawn(slice_events);
    let table = Table {
        services,
        slices,
        targets: Arc::new(Mutex::new(HashMap::new())),
        next: Arc::new(AtomicUsize::new(0)),
    };
    tokio::spawn(serve_dns(
        tokio::net::UdpSocket::from_std(dns)?,
        table.clone(),
        suffix,
    ));
    let mut bound = bound;
    let mut applied = watcher(Api::<Service>::all(client), Default::default())
        .default_backoff()
        .reflect(services_writer)
        .applied_objects()
        .boxed();
    while let Some(event) = applied.next().await {
        let Ok(svc) = event else { continue };
        for (ip, port, port_name) in cluster_ports(&svc) {
            // Updated on every event: a ClusterIP freed and given to another Service, or a port
            // renamed, is forwarded to what the API says now.
            let target = Target {
                namespace: svc.metadata.namespace.clone().unwrap_or_default(),
                service: svc.metadata.name.clone().unwrap_or_default(),
                port_name,
            };
            table
                .targets
                .lock()
                .unwrap()
                .insert((ip, port), target.clone());
            if bound.contains(&(ip, port)) {
                continue;
            }
            match listen(ip, port, table.clone()).await {
                Ok(()) => {
                    bound.insert((ip, port));
                }
                // Tried again at the Service's next event.
                Err(e) => eprintln!(
                    "[service-net] cannot forward {ip}:{port} of {}/{}: {e:#}",
                    target.namespace, target.service
                ),
            }
        }
    }
    Ok(())
}

/// `(ClusterIP, port, port name)` of each TCP port of a Service that has a ClusterIP.
fn cluster_ports(svc: &Service) -> Vec<(Ipv4Addr, u16, String)> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    let Some(ip) = spec
        .cluster_ip
        .as_deref()
        .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
    else {
        return Vec::new();
    };
    spec.ports
        .iter()
        .flatten()
        .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
        .map(|p| (ip, p.port as u16, p.name.clone().unwrap_or_default()))
        .collect()
}

#[derive(Clone)]
struct Target {
    namespace: String,
    service: String,
    port_name: String,
}

#[derive(Clone)]
struct Table {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    /// The Service port each forwarded `ClusterIP:port` belongs to now.
    targets: Arc<Mutex<HashMap<(Ipv4Addr, u16), Target>>>,
    next: Arc<AtomicUsize>,
}

impl Table {
    /// Ready endpoints of a Service as `(address, port of port_name)`; all ports when
    /// `port_name` is `None` (DNS only needs the addresses).
    fn endpoints(
        &self,
        namespace: &str,
        service: &str,
        port_name: Option<&str>,
    ) -> Vec<SocketAddr> {
        let mut out = Vec::new();
        for slice in self.slices.state() {
            if slice.metadata.namespace.as_deref() != Some(namespace)
                || slice
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("kubernetes.io/service-name"))
                    .map(String::as_str)
                    != Some(service)
            {
                continue;
            }
            let port = match port_name {
                Some(name) => slice
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref().unwrap_or("") == name)
                    .and_then(|p| p.port),
                None => Some(0),
            };
            let Some(port) = port else { continue };
            for ep in slice.endpoints.iter().flatten() {
                let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                if !ready {
                    continue;
                }
                for addr in &ep.addresses {
                    if let Ok(ip) = addr.parse::<Ipv4Addr>() {
                        out.push(SocketAddr::from((ip, port as u16)));
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// The Service port `ip:port` forwards to, if a Service still has that ClusterIP (one that
    /// was deleted keeps its listener, which then closes every connection).
    fn current_target(&self, ip: Ipv4Addr, port: u16) -> Option<Target> {
        let target = self.targets.lock().unwrap().get(&(ip, port))?.clone();
        let svc = self
            .services
            .get(&ObjectRef::new(&target.service).within(&target.namespace))?;
        let still_there = cluster_ports(&svc)
            .into_iter()
            .any(|(i, p, _)| (i, p) == (ip, port));
        still_there.then_some(target)
    }

    /// The addresses a cluster DNS name resolves to; `None` for a name that does not exist.
    fn resolve(&self, name: &str, suffix: &str) -> Option<Vec<Ipv4Addr>> {
        let (service, namespace) = name.strip_suffix(suffix)?.split_once('.')?;
        if namespace.contains('.') {
            return None;
        }
        let svc = self
            .services
            .get(&ObjectRef::new(service).within(namespace))?;
        let cluster_ip = svc.spec.as_ref().and_then(|s| s.cluster_ip.as_deref());
        Some(
            match cluster_ip.and_then(|ip| ip.parse::<Ipv4Addr>().ok()) {
                Some(ip) => vec![ip],
                // Headless: the ready pods themselves.
                None => self
                    .endpoints(namespace, service, None)
                    .into_iter()
                    .filter_map(|a| match a {
                        SocketAddr::V4(v4) => Some(*v4.ip()),
                        SocketAddr::V6(_) => None,
                    })
                    .collect(),
            },
        )
    }
}

async fn listen(ip: Ipv4Addr, port: u16, table: Table) -> Result<()> {
    let out = tokio::process::Command::new("ip")
        .args(["addr", "add", &format!("{ip}/32"), "dev", "lo"])
        .output()
        .await
        .context("running ip")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // An address another Service's port already put there (a ClusterIP freed and reused, with
    // another port): iproute2 says "File exists" or, in newer releases, "Address already
    // assigned".
    anyhow::ensure!(
        out.status.success()
            || stderr.contains("File exists")
            || stderr.contains("already assigned"),
        "ip addr add {ip}/32 dev lo: {stderr}"
    );
    let listener = tokio::net::TcpListener::bind((ip, port)).await?;
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let table = table.clone();
            tokio::spawn(async move {
                let Some(target) = table.current_target(ip, port) else {
                    return;
                };
                let endpoints =
                    table.endpoints(&target.namespace, &target.service, Some(&target.port_name));
                if endpoints.is_empty() {
                    return;
                }
                let start = table.next.fetch_add(1, Ordering::Relaxed);
                for i in 0..endpoints.len() {
                    let ep = endpoints[(start + i) % endpoints.len()];
                    if let Ok(Ok(mut outbound)) =
                        tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(ep))
                            .await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

async fn serve_dns(socket: tokio::net::UdpSocket, table: Table, suffix: String) {
    let mut buf = [0u8; 1500];
    while let Ok((len, peer)) = socket.recv_from(&mut buf).await {
        if let Some(reply) = dns_reply(&buf[..len], |name| table.resolve(name, &suffix)) {
            let _ = socket.send_to(&reply, peer).await;
        }
    }
}

/// The reply to one DNS query (RFC 1035 §4): `resolve` maps a lower-case name without the
/// trailing dot to its IPv4 addresses, `None` meaning the name does not exist. `None` for a
/// packet that is not a single well-formed question.
pub fn dns_reply(query: &[u8], resolve: impl Fn(&str) -> Option<Vec<Ipv4Addr>>) -> Option<Vec<u8>> {
    const TYPE_A: u16 = 1;
    const CLASS_IN: u16 = 1;
    if query.len() < 12 || query[2] & 0x80 != 0 || u16::from_be_bytes([query[4], query[5]]) != 1 {
        return None;
    }
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        // A question's name is never compressed.
        if len & 0xC0 != 0 {
            return None;
        }
        labels.push(
            std::str::from_utf8(query.get(at..at + len)?)
                .ok()?
                .to_ascii_lowercase(),
        );
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let qclass = u16::from_be_bytes([*query.get(at + 2)?, *query.get(at + 3)?]);
    let question = &query[12..at + 4];
    let found = resolve(&labels.join("."));
    let answers = match (&found, qtype, qclass) {
        (Some(ips), TYPE_A, CLASS_IN) => ips.clone(),
        _ => Vec::new(),
    };
    let mut reply = Vec::with_capacity(question.len() + 12 + answers.len() * 16);
    reply.extend_from_slice(&query[..2]);
    // QR, opcode 0, AA, RD copied; RA; RCODE 0 or NXDOMAIN.
    reply.push(0x84 | (query[2] & 0x01));
    reply.push(0x80 | if found.is_none() { 3 } else { 0 });
    reply.extend_from_slice(&1u16.to_be_bytes());
    reply.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    reply.extend_from_slice(&[0, 0, 0, 0]);
    reply.extend_from_slice(question);
    for ip in answers {
        // Name: a pointer to the question's name at offset 12.
        reply.extend_from_slice(&[0xC0, 0x0C]);
        reply.extend_from_slice(&TYPE_A.to_be_bytes());
        reply.extend_from_slice(&CLASS_IN.to_be_bytes());
        reply.extend_from_slice(&DNS_TTL_SECONDS.to_be_bytes());
        reply.extend_from_slice(&4u16.to_be_bytes());
        reply.extend_from_slice(&ip.octets());
    }
    Some(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        q
    }

    fn resolve(name: &str) -> Option<Vec<Ipv4Addr>> {
        (name == "db.ns.svc.cluster.local").then(|| vec![Ipv4Addr::new(10, 0, 0, 7)])
    }

    #[test]
    fn answers_a_record_of_a_known_name_case_insensitively() {
        let q = query("DB.ns.svc.cluster.local", 1);
        let r = dns_reply(&q, resolve).unwrap();
        assert_eq!(&r[..2], &[0x12, 0x34], "id echoed");
        assert_eq!(r[2] & 0x80, 0x80, "a response");
        assert_eq!(r[3] & 0x0F, 0, "NOERROR");
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 1, "one answer");
        assert_eq!(&r[r.len() - 4..], &[10, 0, 0, 7]);
        assert_eq!(&r[12..q.len()], &q[12..], "question echoed");
    }

    #[test]
    fn unknown_names_are_nxdomain_and_other_types_empty() {
        let r = dns_reply(&query("db.ns.svc.ns.svc.cluster.local", 1), resolve).unwrap();
        assert_eq!(r[3] & 0x0F, 3);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 0);
        let r = dns_reply(&query("db.ns.svc.cluster.local", 28), resolve).unwrap();
        assert_eq!(r[3] & 0x0F, 0, "AAAA of a known name: NOERROR without data");
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 0);
    }

    #[test]
    fn malformed_packets_get_no_reply() {
        assert!(dns_reply(&[0; 5], resolve).is_none());
        let mut q = query("db.ns.svc.cluster.local", 1);
        q.truncate(q.len() - 3);
        assert!(dns_reply(&q, resolve).is_none());
    }
}
