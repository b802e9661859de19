#!/usr/bin/env python3
"""Creates policy reports through kube-apiserver with plain HTTP clients that decode nothing.

An independent check of `reports-server bench`'s create figure (issue 37, target 0): THREADS
threads, each with its own keep-alive HTTPS/1.1 connection (Python's http.client, as the
harness that first disagreed with ours), POST one report each at a time and read the answer's
bytes without parsing them. Every body is the template with its namespace, pod name and uid
replaced as text, so the client does no JSON work either.

With --pid NAME=PID (repeatable) it also prints the CPU time each process and its descendants
(PostgreSQL's backends are children of its postmaster) spent during the creates, per create;
with --metrics-url it reads our server's group-commit histograms before and after (writes per
round, seconds per round).

    python3 bench/plain_creates.py --kubeconfig KC --template report.json --reports 10000 \\
        --threads 8 --namespaces 30 [--pid kube-apiserver=PID ...] [--metrics-url URL] [--json OUT]

The template is one PolicyReport in JSON whose namespace is __NAMESPACE__, whose pod is
__POD__ and whose uid is __UID__ wherever they occur (`side-by-side --driver plain` writes it
from the same fixture `bench` uses). Needs PyYAML to read the kubeconfig
(apt-get install -y python3-yaml).
"""

import argparse
import base64
import http.client
import json
import os
import resource
import ssl
import sys
import tempfile
import threading
import time
import urllib.parse

try:
    import yaml
except ImportError:
    sys.exit("plain_creates.py needs PyYAML to read the kubeconfig: apt-get install -y python3-yaml")

USER_HZ = os.sysconf("SC_CLK_TCK")
GROUP_PATH = "/apis/wgpolicyk8s.io/v1alpha2"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--template", required=True, help="one PolicyReport in JSON with __NAMESPACE__, __POD__, __UID__")
    p.add_argument("--reports", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--namespaces", type=int, default=30)
    p.add_argument("--pid", action="append", default=[], help="NAME=PID: CPU of the process and its descendants")
    p.add_argument("--metrics-url", help="our server's /metrics, read with the kubeconfig's client certificate")
    p.add_argument("--json", help="write the figures here as JSON")
    return p.parse_args()


class Cluster:
    """The kubeconfig's current cluster and user, as an ssl context and a host and port."""

    def __init__(self, path):
        with open(path) as f:
            config = yaml.safe_load(f)
        context_name = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        url = urllib.parse.urlparse(cluster["server"])
        self.host, self.port = url.hostname, url.port or 443
        self.files = tempfile.TemporaryDirectory(prefix="plain-creates-")
        self.ssl = ssl.create_default_context(cafile=self._file(cluster, "certificate-authority"))
        cert = self._file(user, "client-certificate")
        key = self._file(user, "client-key")
        if cert is None or key is None:
            sys.exit("plain_creates.py authenticates with the kubeconfig's client certificate; this user has none")
        self.ssl.load_cert_chain(cert, key)
        self.cert, self.key = cert, key

    def _file(self, section, field):
        if field in section:
            return section[field]
        data = section.get(field + "-data")
        if data is None:
            return None
        path = os.path.join(self.files.name, field)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def connect(self):
        return http.client.HTTPSConnection(self.host, self.port, context=self.ssl, timeout=60)


def request(conn, method, path, body=None):
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    return response.status, data


def ensure_namespaces(cluster, count):
    conn = cluster.connect()
    for i in range(count):
        body = json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"bench-{i}"}})
        status, data = request(conn, "POST", "/api/v1/namespaces", body)
        if status not in (201, 409):
            sys.exit(f"creating namespace bench-{i}: HTTP {status}: {data[:300]!r}")
    conn.close()


def cpu_ticks(pid, reaped=False):
    """utime + stime of one process in clock ticks, plus cutime + cstime (its children that have
    exited and been waited for) when `reaped`; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = [int(v) for v in stat.rsplit(")", 1)[1].split()[11:15]]
    return fields[0] + fields[1] + (fields[2] + fields[3] if reaped else 0)


def process_tree(root):
    """`root` and every live descendant of it."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_cpu(root):
    """Ticks spent so far by the tree under `root`: every live process of it, and the children
    `root` has reaped (a PostgreSQL backend that exited during the run, as the peer's pool closes
    connections beyond its two idle ones, is counted by its postmaster's cutime)."""
    total = 0
    for pid in process_tree(root):
        ticks = cpu_ticks(pid, reaped=(pid == root))
        total += ticks or 0
    return total


def group_commit(cluster, url):
    """Sums and counts of our group-commit histograms, or None when unreadable."""
    parsed = urllib.parse.urlparse(url)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(cluster.cert, cluster.key)
    conn = http.client.HTTPSConnection(parsed.hostname, parsed.port, context=context, timeout=30)
    status, data = request(conn, "GET", parsed.path or "/metrics")
    conn.close()
    if status != 200:
        print(f"[plain-creates] {url}: HTTP {status}; no group-commit figures", file=sys.stderr)
        return None
    wanted = {}
    for line in data.decode().splitlines():
        for name in ("writes", "round_seconds"):
            prefix = f"reports_server_store_group_commit_{name}_"
            for suffix in ("sum", "count"):
                if line.startswith(prefix + suffix + " "):
                    wanted[f"{name}_{suffix}"] = float(line.split()[1])
    return wanted


def creator(cluster, template, jobs, latencies, errors):
    """Creates the reports numbered `jobs` one after another on one connection."""
    conn = cluster.connect()
    for n in jobs:
        namespace = f"bench-{n % namespaces_count}"
        uid = f"{n:08x}-0000-4000-8000-{n:012x}"
        body = template.replace("__NAMESPACE__", namespace).replace("__POD__", f"pod-{n}").replace("__UID__", uid)
        path = f"{GROUP_PATH}/namespaces/{namespace}/policyreports"
        started = time.perf_counter()
        try:
            status, data = request(conn, "POST", path, body.encode())
        except (OSError, http.client.HTTPException) as e:
            errors.append(f"report {n}: {e}")
            conn.close()
            conn = cluster.connect()
            continue
        if status == 201:
            latencies.append(time.perf_counter() - started)
        else:
            errors.append(f"report {n}: HTTP {status}: {data[:300]!r}")
    conn.close()


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main():
    global namespaces_count
    args = parse_args()
    namespaces_count = args.namespaces
    cluster = Cluster(args.kubeconfig)
    with open(args.template) as f:
        template = f.read()
    for token in ("__NAMESPACE__", "__POD__", "__UID__"):
        if token not in template:
            sys.exit(f"the template {args.template} has no {token}")
    ensure_namespaces(cluster, args.namespaces)
    pids = {}
    for spec in args.pid:
        name, _, pid = spec.partition("=")
        pids[name] = int(pid)
    metrics_before = group_commit(cluster, args.metrics_url) if args.metrics_url else None
    cpu_before = {name: tree_cpu(pid) for name, pid in pids.items()}
    own_before = resource.getrusage(resource.RUSAGE_SELF)

    latencies, errors = [], []
    threads = [
        threading.Thread(target=creator, args=(cluster, template, range(t, args.reports, args.threads), latencies, errors))
        for t in range(args.threads)
    ]
    print(f"[plain-creates] {args.reports} creates, {args.threads} threads", file=sys.stderr)
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started

    own_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = {name: (tree_cpu(pid) - cpu_before[name]) / USER_HZ for name, pid in pids.items()}
    cpu["client"] = (own_after.ru_utime - own_before.ru_utime) + (own_after.ru_stime - own_before.ru_stime)
    if errors:
        print(f"[plain-creates] {len(errors)} creates failed; first: {errors[0]}", file=sys.stderr)
    done = len(latencies)
    latencies.sort()
    figures = {
        "reports": args.reports,
        "threads": args.threads,
        "created": done,
        "failed": len(errors),
        "seconds": elapsed,
        "create_per_s": done / elapsed,
        "latency_p50_ms": percentile(latencies, 0.50) * 1000,
        "latency_p99_ms": percentile(latencies, 0.99) * 1000,
        "cpu_seconds": cpu,
        "cpu_ms_per_create": {name: s * 1000 / max(done, 1) for name, s in cpu.items()},
        "load_average": os.getloadavg()[0],
    }
    if metrics_before is not None:
        after = group_commit(cluster, args.metrics_url)
        if after is not None:
            rounds = after.get("writes_count", 0) - metrics_before.get("writes_count", 0)
            writes = after.get("writes_sum", 0) - metrics_before.get("writes_sum", 0)
            seconds = after.get("round_seconds_sum", 0) - metrics_before.get("round_seconds_sum", 0)
            figures["group_commit"] = {
                "rounds": rounds,
                "writes_per_round": writes / rounds if rounds else float("nan"),
                "round_ms": seconds * 1000 / rounds if rounds else float("nan"),
            }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
