//! What `deploy/` ships for monitoring holds together:
//!
//! - the Prometheus alert rules pass `promtool check rules` and their unit
//!   tests (`promtool test rules`), and the example scrape config loads them;
//! - every query of the Grafana dashboard is valid PromQL, and every panel
//!   queries the data source variable;
//! - every `outbox_relay_*` name the dashboard and the rules query is a
//!   series a running relay exports (scraped from its `/metrics`).
//!
//! - the systemd unit passes `systemd-analyze verify` and scores well in
//!   `systemd-analyze security --offline`, loads its passwords as
//!   credentials and sets none in its environment; the Kubernetes manifest
//!   parses, mounts no service account token and limits the pod's traffic;
//! - the probes the manifest sends are answered through a flood of idle
//!   connections to the HTTP port.
//!
//! promtool comes with Debian's `prometheus` package, systemd-analyze with
//! `systemd`, PyYAML (the manifest is read with it) with `python3-yaml`,
//! which `integration/servers.sh install` installs; without them these
//! tests fail.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;

const RULES: &str = "deploy/prometheus/outbox-relay.rules.yml";
const RULES_TEST: &str = "deploy/prometheus/outbox-relay.rules.test.yml";
const PROMETHEUS_YML: &str = "deploy/prometheus/prometheus.yml";
const DASHBOARD: &str = "deploy/grafana/outbox-relay.json";
const UNIT: &str = "deploy/systemd/outbox-relay.service";
const MANIFEST: &str = "deploy/kubernetes/outbox-relay.yaml";

/// `promtool ARGS` in the repository's root.
fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's `prometheus` package \
                 (apt-get install --no-install-recommends prometheus, or \
                 integration/servers.sh install)"
            )
        })
}

/// Runs promtool and panics with its output unless it succeeds.
fn promtool_ok(args: &[&str]) -> String {
    let out = promtool(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool {} failed ({}):\n{text}",
        args.join(" "),
        out.status
    );
    text
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let check = promtool_ok(&["check", "rules", RULES]);
    assert!(check.contains("SUCCESS"), "{check}");
    let test = promtool_ok(&["test", "rules", RULES_TEST]);
    assert!(test.contains("SUCCESS"), "{test}");
}

#[test]
fn every_alert_has_unit_tests_severity_and_annotations() {
    let rules = read(RULES);
    let tests = read(RULES_TEST);
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 10, "alerts found: {alerts:?}");
    for alert in &alerts {
        // A case where it fires (exp_alerts with labels) and one where it
        // must not (exp_alerts: []), for this alert by name.
        let cases: Vec<&str> = tests
            .split("alertname: ")
            .skip(1)
            .filter(|c| c.split_whitespace().next() == Some(alert))
            .collect();
        assert!(
            cases.iter().any(|c| c.contains("exp_labels:")),
            "{alert}: no firing case in {RULES_TEST}"
        );
        assert!(
            cases.iter().any(|c| c
                .lines()
                .nth(1)
                .is_some_and(|l| l.contains("exp_alerts: []"))),
            "{alert}: no case where it must not fire in {RULES_TEST}"
        );
    }
    // Each rule block: severity, summary, description.
    for block in rules.split("- alert: ").skip(1) {
        let name = block.split_whitespace().next().unwrap();
        for key in ["severity: ", "summary: ", "description: "] {
            assert!(block.contains(key), "{name}: no {key}");
        }
    }
}

#[test]
fn example_prometheus_config_is_valid_and_loads_the_rules() {
    let out = promtool_ok(&["check", "config", PROMETHEUS_YML]);
    assert!(out.contains("1 rule files found"), "{out}");
    let cfg = read(PROMETHEUS_YML);
    assert!(cfg.contains("job_name: outbox-relay"), "{cfg}");
    // The default of http.listen (src/config.rs).
    assert!(cfg.contains("localhost:9187"), "{cfg}");
}

#[test]
fn dashboard_is_well_formed_and_its_queries_are_valid_promql() {
    let dash = dashboard();
    assert_eq!(dash["uid"], "outbox-relay");
    assert!(dash["schemaVersion"].as_u64().unwrap() >= 36);
    let vars: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        vars.contains(&"DS_PROMETHEUS") && vars.contains(&"instance"),
        "{vars:?}"
    );

    let mut ids = BTreeSet::new();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "duplicate id: {title}"
        );
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{title}: wider than the grid"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            let expr = t["expr"].as_str().unwrap();
            assert!(
                expr.contains("$instance"),
                "{title}: not filtered by $instance: {expr}"
            );
            exprs.push((title.to_owned(), expr.to_owned()));
        }
    }
    assert!(exprs.len() >= 15, "{exprs:?}");

    // promtool parses PromQL only in rules: one recording rule per query,
    // with Grafana's variables replaced by what it would send.
    let mut yaml = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$__range", "6h")
            .replace("$instance", ".+");
        // A JSON string is a YAML double-quoted scalar.
        yaml += &format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard.rules.yml");
    std::fs::write(&file, &yaml).unwrap();
    let out = promtool(&["check", "rules", file.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "a dashboard query is not valid PromQL:\n{}{}\nqueries:\n{yaml}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_rules_query_only_metrics_the_relay_exports() {
    // What they query, by file.
    let mut wanted: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    let mut dash_exprs = Vec::new();
    collect_exprs(&dashboard(), &mut dash_exprs);
    for e in &dash_exprs {
        for n in metric_names(e) {
            wanted.entry(n).or_default().insert(DASHBOARD);
        }
    }
    let rules = read(RULES);
    for e in rule_exprs(&rules) {
        for n in metric_names(&e) {
            wanted.entry(n).or_default().insert(RULES);
        }
    }
    // The extraction itself works: both files name the core metrics.
    for (name, file) in [
        ("outbox_relay_streaming", DASHBOARD),
        ("outbox_relay_streaming", RULES),
        ("outbox_relay_confirm_latency_seconds_bucket", DASHBOARD),
        ("outbox_relay_events_total", RULES),
    ] {
        assert!(
            wanted.get(name).is_some_and(|f| f.contains(file)),
            "{name} not found in {file}: {wanted:?}"
        );
    }

    // A relay that has published an event, dead-lettered one (after
    // retries: it was unroutable) and reconnected once: prometheus-client
    // leaves a labelled family out of /metrics altogether (no `# TYPE`
    // either) until it has a label value, so each must have happened.
    let mut fx = Fixture::new("deploy").await;
    let dlx = fx.scoped("dlx");
    fx.declare_bound(&dlx, Some(&fx.scoped("dlq")), "#").await;
    fx.rebind_queue("ok.#").await; // 'lost.*' routing keys go nowhere
    fx.set_config_extra(
        &format!("dead_letter_exchange = \"{dlx}\"\nunroutable_retries = 2\nretry_backoff_ms = 50"),
        "",
    );
    fx.start_consumer().await;
    let mut dlq = fx.consume(&fx.scoped("dlq")).await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_LOG_FORMAT", "json")]);
    let addr = relay.http_addr().await;
    let lost = fx
        .insert(&pg, "lost", "1", "e", &serde_json::json!({"deploy": 0}))
        .await;
    let ok = fx
        .insert(&pg, "ok", "1", "e", &serde_json::json!({"deploy": 1}))
        .await;
    fx.expect_delivered(&[ok], &relay).await;
    match tokio::time::timeout(Duration::from_secs(30), dlq.recv()).await {
        Ok(Some(r)) => assert_eq!(r.message_id(), lost),
        _ => panic!("no dead letter; relay log:\n{}", relay.log_tail()),
    }
    fx.terminate_walsender(&pg)
        .await
        .expect("a walsender streams the slot");

    let deadline = Instant::now() + Duration::from_secs(30);
    let scrape = loop {
        let (code, body) = http_get(&addr, "/metrics").await;
        assert_eq!(code, 200, "{body}");
        let done = [
            "outbox_relay_events_total{outcome=\"published\"} 1",
            "outbox_relay_events_total{outcome=\"dead_lettered\"} 1",
            "outbox_relay_retries_total{reason=\"returned\"} ",
            "outbox_relay_reconnects_total{target=\"postgres\"} ",
            // Polled every 5 s, by a streaming relay.
            "\noutbox_relay_retained_wal_bytes ",
        ]
        .iter()
        .all(|s| body.contains(s));
        // Streaming again after the reconnect.
        if done && body.contains("\noutbox_relay_streaming 1") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "the relay's /metrics never showed the event, the dead letter, the retry, the reconnect and the retained WAL:\n{body}\nrelay log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let exported = exported_series(&scrape);
    let missing: Vec<String> = wanted
        .iter()
        .filter(|(n, _)| !exported.contains(n.as_str()))
        .map(|(n, files)| format!("{n} (in {files:?})"))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exported by the relay: {missing:#?}\nexported series: {exported:#?}\n/metrics:\n{scrape}"
    );

    relay.stop_ok();
    fx.cleanup().await;
}

/// `systemd-analyze ARGS`; its exit status and everything it printed.
fn systemd_analyze(args: &[&str]) -> (bool, String) {
    let out = Command::new("systemd-analyze")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run systemd-analyze ({e}): install Debian's `systemd` package")
        });
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn systemd_unit_verifies_is_sandboxed_and_loads_its_secrets_as_credentials() {
    let unit = read(UNIT);
    // Verified as installed, with the relay at the path the unit runs
    // (here, the one just built).
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("outbox-relay.service");
    std::fs::write(
        &copy,
        unit.replace("/usr/bin/outbox-relay", env!("CARGO_BIN_EXE_outbox-relay")),
    )
    .unwrap();
    let copy = copy.to_str().unwrap();
    let (ok, said) = systemd_analyze(&["verify", copy]);
    assert!(
        ok && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );
    let (ok, said) = systemd_analyze(&["security", "--offline=true", copy]);
    assert!(ok, "systemd-analyze security --offline:\n{said}");
    let exposure: f64 = said
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for outbox-relay.service: ")
                .nth(1)
        })
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure level:\n{said}"));
    assert!(
        exposure <= 1.2,
        "exposure {exposure} (left open: network access, which the relay needs):\n{said}"
    );

    let values = |key: &str| -> Vec<&str> {
        unit.lines()
            .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .collect()
    };
    // The credentials the config's password files name, from the
    // credential store; the memory, core and sandbox settings.
    assert_eq!(
        values("LoadCredential"),
        [
            "postgres-password:outbox-relay.postgres-password",
            "rabbitmq-password:outbox-relay.rabbitmq-password"
        ]
    );
    assert!(unit.contains("password_file = \"$CREDENTIALS_DIRECTORY/postgres-password\""));
    assert!(unit.contains("password_file = \"$CREDENTIALS_DIRECTORY/rabbitmq-password\""));
    for (key, want) in [
        ("MemoryMax", "256M"),
        ("MemorySwapMax", "0"),
        ("LimitCORE", "0"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("PrivateUsers", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("CapabilityBoundingSet", ""),
    ] {
        assert_eq!(values(key), [want], "{key}=");
    }
    assert!(values("SystemCallFilter").contains(&"@system-service"));
    // Nothing secret in the environment, which any local user may read
    // over D-Bus.
    for env in values("Environment") {
        let name = env.split('=').next().unwrap_or_default();
        assert!(
            !["URL", "PASSWORD"].iter().any(|s| name.contains(s)),
            "Environment={env}"
        );
    }
}

/// The documents of a YAML file, as JSON (read with PyYAML).
fn yaml_documents(rel: &str) -> Vec<serde_json::Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(sys.stdin)), sys.stdout)",
        ])
        .stdin(std::fs::File::open(repo_path(rel)).unwrap())
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{rel} does not parse as YAML (or PyYAML is missing: apt-get install python3-yaml):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn kubernetes_manifest_mounts_no_token_and_limits_the_pods_traffic() {
    let docs = yaml_documents(MANIFEST);
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k} in {MANIFEST}"))
    };
    let deployment = kind("Deployment");
    let pod = &deployment["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    let spec = &pod["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false);
    let container = &spec["containers"][0];
    let port = container["ports"][0]["containerPort"].as_u64().unwrap();
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"], "http", "{probe}");
    }
    assert_eq!(container["resources"]["limits"]["memory"], "256Mi");

    let policy = kind("NetworkPolicy");
    let policy = &policy["spec"];
    assert_eq!(
        &policy["podSelector"]["matchLabels"], labels,
        "the policy selects the relay's pods"
    );
    let types: Vec<&str> = (policy["policyTypes"].as_array().unwrap().iter())
        .filter_map(|t| t.as_str())
        .collect();
    assert_eq!(types, ["Ingress", "Egress"]);
    let ports = |rules: &serde_json::Value| -> BTreeSet<u64> {
        (rules.as_array().unwrap().iter())
            .flat_map(|r| r["ports"].as_array().unwrap().iter())
            .filter_map(|p| p["port"].as_u64())
            .collect()
    };
    assert_eq!(ports(&policy["ingress"]), BTreeSet::from([port]));
    for rule in policy["ingress"].as_array().unwrap() {
        assert!(!rule["from"].as_array().unwrap().is_empty(), "open ingress");
    }
    assert_eq!(
        ports(&policy["egress"]),
        BTreeSet::from([53, 5432, 5671, 5672])
    );
}

/// The probes get through while hundreds of idle connections (a slowloris
/// flood, far beyond the relay's cap of 64) hold the HTTP port open. The
/// relay runs as the unit runs it: its PostgreSQL password from the
/// credentials directory (the URL's own is wrong).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_through_a_flood_of_idle_connections() {
    use std::os::unix::fs::PermissionsExt;
    let fx = Fixture::new("deploy_flood").await;
    let credentials = tempfile::tempdir().unwrap();
    let password = pg_url()
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .get_password()
        .map(|p| String::from_utf8(p.to_vec()).unwrap())
        .expect("TEST_PG_URL has a password");
    let file = credentials.path().join("postgres-password");
    std::fs::write(&file, &password).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let wrong = fx
        .pg_url
        .replace(&format!(":{password}@"), ":not-the-password@");
    assert_ne!(wrong, fx.pg_url);
    let relay = fx.spawn_relay_env(&[
        ("OUTBOX_RELAY_LOG_FORMAT", "json"),
        ("OUTBOX_RELAY_POSTGRES_URL", &wrong),
        (
            "CREDENTIALS_DIRECTORY",
            credentials.path().to_str().unwrap(),
        ),
        (
            "OUTBOX_RELAY_POSTGRES_PASSWORD_FILE",
            "$CREDENTIALS_DIRECTORY/postgres-password",
        ),
    ]);
    let addr = relay.http_addr().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(&addr, "/readyz").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "never ready; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut flood = Vec::new();
    for _ in 0..300 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        // Half a request, never finished.
        use tokio::io::AsyncWriteExt;
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x").await;
        flood.push(s);
    }
    // Every probe is answered while the flood holds on. /readyz answers
    // what the relay is doing: a session that reconnects meanwhile (it
    // happened once in CI, cause unknown; the log is printed) answers 503
    // until it streams again, within the deadline.
    let flood_log = || relay.log_but("HTTP connection ended");
    for _ in 0..3 {
        let (code, body) = http_get(&addr, "/healthz").await;
        assert_eq!(code, 200, "/healthz: {body}; log:\n{}", flood_log());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ready = 0;
    while ready < 3 {
        let (code, body) = http_get(&addr, "/readyz").await;
        match code {
            200 => ready += 1,
            503 if Instant::now() < deadline => {
                eprintln!("/readyz during the flood: {body}; log:\n{}", flood_log());
                ready = 0;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => panic!("/readyz: {code} {body}; log:\n{}", flood_log()),
        }
    }
    drop(flood);
    relay.stop_ok();
    fx.cleanup().await;
}

// ---------------------------------------------------------------- helpers

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_path(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every `"expr"` string anywhere in the dashboard (panels, rows' panels,
/// variables).
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// The `expr:` values of a rules file: inline, or a block scalar (`|`,
/// `>-`, ...) of the lines indented deeper than the key.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let indent = line.len() - line.trim_start().len();
        let rest = rest.trim();
        if rest.starts_with('|') || rest.starts_with('>') {
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            out.push(block.join("\n"));
        } else {
            out.push(rest.to_owned());
        }
    }
    out
}

/// The `outbox_relay_*` names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let is_name = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("outbox_relay_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let len = tail.find(|c: char| !is_name(c)).unwrap_or(tail.len());
        if !before.is_some_and(|c| is_name(c) || c.is_ascii_alphabetic() || c == ':') {
            out.insert(tail[..len].to_owned());
        }
        rest = &tail[len..];
    }
    out
}

/// The series names a scrape offers to queries: those with samples, and
/// those of every declared family (`# TYPE`), as Prometheus names them: a
/// counter `x` is `x_total`, a histogram `x_bucket`, `x_sum` and `x_count`.
/// (prometheus-client 0.26 declares a family only once it has a sample; the
/// declarations are counted too in case a later version declares empty
/// families.)
fn exported_series(scrape: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut declared = BTreeSet::new();
    for line in scrape.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            let mut parts = decl.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            let names: Vec<String> = match kind {
                "counter" => vec![format!("{name}_total")],
                "histogram" => ["_bucket", "_sum", "_count"]
                    .iter()
                    .map(|s| format!("{name}{s}"))
                    .collect(),
                _ => vec![name.to_owned()],
            };
            declared.extend(names.iter().cloned());
            out.extend(names);
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                declared.contains(name),
                "sample {name} without a matching # TYPE line:\n{scrape}"
            );
            out.insert(name.to_owned());
        }
    }
    out
}

/// The bound address of the relay's HTTP endpoint, from its JSON log.
#[test]
fn metric_names_and_rule_exprs_extract_what_they_should() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(outbox_relay_confirm_latency_seconds_bucket{instance=~\"$instance\"}[5m]))) / x_outbox_relay_not"
        ),
        BTreeSet::from(["outbox_relay_confirm_latency_seconds_bucket".to_owned()])
    );
    let yaml = "      - alert: A\n        expr: up == 0\n      - alert: B\n        expr: |\n          a\n            / b\n\n        for: 5m\n";
    assert_eq!(
        rule_exprs(yaml),
        ["up == 0", "          a\n            / b\n"]
    );
}
