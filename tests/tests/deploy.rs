//! deploy/ tested as far as this machine allows: the Kubernetes manifests
//! validated by an existing schema validator (kubernetes-validate, from
//! scripts/setup.sh, at a pinned Kubernetes version, no network), the
//! Gateway API Inference Extension example checked for its release's fields,
//! the manifests and the Containerfile checked against each other (probes on
//! the served port, a grace period covering preStop + the shutdown timeout,
//! selectors on the Deployment's labels, one served model name), and the
//! container's build steps (deploy/build-steps.sh) run on the host, whose
//! artifact is then served with the Deployment's own flags on loopback.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use maxc_tests::*;
use serde_json::{json, Value};

/// The Kubernetes version the manifests are validated against (the preStop
/// `sleep` action is in every version since 1.30).
const KUBERNETES_VERSION: &str = "1.33.0";

/// The manifests kubernetes-validate has schemas for (the core API).
const CORE: [&str; 4] = ["deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml"];

fn kube_dir() -> PathBuf {
    workspace_root().join("deploy/kubernetes")
}

fn validator_lib() -> PathBuf {
    let lib = workspace_root().join(".cache/kubernetes-validate");
    assert!(lib.join("kubernetes_validate").is_dir(), "{} is missing: run scripts/setup.sh", lib.display());
    lib
}

/// Every YAML document of a file, as JSON (PyYAML, a dependency of
/// kubernetes-validate, parses it).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args(["-c", "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))"])
        .arg(path)
        .env("PYTHONPATH", validator_lib())
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn doc(file: &str) -> Value {
    let mut d = yaml_docs(&kube_dir().join(file));
    assert_eq!(d.len(), 1, "{file}: one document");
    d.remove(0)
}

/// Runs kubernetes-validate (strict: unknown fields are errors) on files.
fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION])
        .args(files)
        .env("PYTHONPATH", validator_lib())
        .output()
        .expect("python3 runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let files: Vec<PathBuf> = CORE.iter().map(|f| kube_dir().join(f)).collect();
    let (ok, log) = validate(&files);
    assert!(ok, "{log}");
    assert_eq!(log.matches(" passed for resource ").count(), CORE.len(), "{log}");
    // The validator catches what a wrong manifest gets wrong: a field the API
    // does not have, a port that is not a number.
    let dir = temp_dir("deploy-invalid");
    for (what, from, to) in [
        ("unknown field", "terminationGracePeriodSeconds: 45", "terminationGracePeriod: 45"),
        ("port type", "containerPort: 8000", "containerPort: http-port"),
    ] {
        let text = std::fs::read_to_string(kube_dir().join("deployment.yaml")).unwrap();
        assert!(text.contains(from), "{from}");
        let bad = dir.as_path().join("deployment.yaml");
        std::fs::write(&bad, text.replace(from, to)).unwrap();
        let (ok, log) = validate(&[bad]);
        assert!(!ok, "{what}: the broken Deployment validated: {log}");
    }
}

/// The serve flags of the Deployment's container, `--name=value` as a map.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().find_map(|a| a.strip_prefix(&format!("--{name}=")).map(str::to_string))
}

fn container(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

fn container_args(deployment: &Value) -> Vec<String> {
    let c = container(deployment);
    let mut all: Vec<String> = c["command"].as_array().into_iter().flatten().chain(c["args"].as_array().into_iter().flatten()).map(|v| v.as_str().unwrap().to_string()).collect();
    if all.first().map(String::as_str) == Some("maxrun") {
        all.remove(0);
    }
    all
}

fn port_number(c: &Value, port: &Value) -> Option<u64> {
    port.as_u64().or_else(|| {
        let name = port.as_str()?;
        c["ports"].as_array()?.iter().find(|p| p["name"] == name)?["containerPort"].as_u64()
    })
}

/// What is wrong between the manifests (empty: nothing): the checks a wrong
/// manifest fails, applied to the real ones and to broken copies.
fn problems(m: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            bad.push(what)
        }
    };
    let dep = &m["deployment"];
    let c = container(dep);
    let args = container_args(dep);
    check(args.first().map(String::as_str) == Some("serve"), format!("the container runs `maxrun serve`: {args:?}"));
    let port: u64 = flag(&args, "port").and_then(|p| p.parse().ok()).unwrap_or(8000);
    check(flag(&args, "host").as_deref() == Some("0.0.0.0"), "serve listens on 0.0.0.0 in the pod".into());
    check(c["ports"].as_array().is_some_and(|p| p.iter().any(|p| p["containerPort"] == port)), format!("containerPort {port} declared"));
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let h = &c[probe]["httpGet"];
        check(h["path"] == "/health", format!("{probe} on /health"));
        check(port_number(c, &h["port"]) == Some(port), format!("{probe} on port {port}"));
    }
    let startup = &c["startupProbe"];
    let budget = startup["periodSeconds"].as_u64().unwrap_or(10) * startup["failureThreshold"].as_u64().unwrap_or(3);
    check(budget >= 30, format!("the startup probe allows loading ({budget} s)"));
    let shutdown: u64 = flag(&args, "shutdown-timeout").and_then(|p| p.parse().ok()).unwrap_or(30);
    let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap_or(0);
    check(pre_stop > 0, "a preStop sleep lets the endpoints drop the pod before the drain".into());
    let grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    check(grace > shutdown + pre_stop, format!("grace {grace} s > preStop {pre_stop} s + shutdown timeout {shutdown} s"));
    // The engine's threads follow the CPU limit.
    check(flag(&args, "threads").as_deref() == Some("$(MAXRUN_THREADS)"), "--threads from MAXRUN_THREADS".into());
    let env = c["env"].as_array().and_then(|e| e.iter().find(|e| e["name"] == "MAXRUN_THREADS").cloned()).unwrap_or(Value::Null);
    check(env["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu", "MAXRUN_THREADS is limits.cpu".into());
    let limits = &c["resources"]["limits"];
    check(limits["cpu"].is_string() && limits["memory"].is_string() && c["resources"]["requests"]["memory"].is_string(), "requests and limits".into());
    let labels = &dep["spec"]["template"]["metadata"]["labels"];
    check(&dep["spec"]["selector"]["matchLabels"] == labels, "the Deployment selects its own pods".into());
    let svc = &m["service"]["spec"];
    check(&svc["selector"] == labels, "the Service selects the pods".into());
    check(svc["ports"].as_array().is_some_and(|p| p.iter().all(|p| port_number(c, &p["targetPort"]) == Some(port))), format!("Service targetPort {port}"));
    check(&m["pdb"]["spec"]["selector"]["matchLabels"] == labels, "the PDB selects the pods".into());
    let hpa = &m["hpa"]["spec"];
    check(hpa["scaleTargetRef"]["kind"] == "Deployment" && hpa["scaleTargetRef"]["name"] == dep["metadata"]["name"], "the HPA scales the Deployment".into());
    check(
        hpa["metrics"].as_array().is_some_and(|ms| ms.iter().any(|x| x["type"] == "Pods" && x["pods"]["metric"]["name"].as_str().is_some_and(|n| n.contains("num_requests_waiting")))),
        "the HPA scales on waiting requests per pod".into(),
    );
    check(hpa["minReplicas"].as_u64().unwrap_or(1) >= 2, "at least two replicas, so the PDB lets a drain through".into());
    let served = flag(&args, "served-model-name");
    check(served.is_some(), "--served-model-name set".into());
    let (pool, model) = (&m["pool"], &m["model"]);
    check(pool["spec"]["selector"] == *labels, "the InferencePool selects the pods".into());
    check(pool["spec"]["targetPortNumber"] == port, format!("the InferencePool targets port {port}"));
    check(model["spec"]["poolRef"]["name"] == pool["metadata"]["name"], "the InferenceModel names the pool".into());
    check(model["spec"]["modelName"].as_str() == served.as_deref(), "the InferenceModel's modelName is --served-model-name".into());
    let entry = &m["entrypoint"];
    for name in ["port", "shutdown-timeout", "served-model-name", "host"] {
        check(entry.get(name).and_then(Value::as_str) == flag(&args, name).as_deref(), format!("the Containerfile's --{name} is the Deployment's"));
    }
    bad
}

/// The Containerfile's ENTRYPOINT flags (`--name value`) as a JSON object.
fn containerfile_entrypoint() -> Value {
    let text = std::fs::read_to_string(workspace_root().join("deploy/Containerfile")).unwrap();
    let line = text.lines().rfind(|l| l.starts_with("ENTRYPOINT ")).expect("an ENTRYPOINT");
    let words: Vec<String> = serde_json::from_str(line.trim_start_matches("ENTRYPOINT ")).expect("exec form");
    assert_eq!(&words[..2], ["maxrun", "serve"]);
    let mut flags = serde_json::Map::new();
    for pair in words[3..].chunks(2) {
        flags.insert(pair[0].trim_start_matches("--").to_string(), json!(pair.get(1).cloned().unwrap_or_default()));
    }
    Value::Object(flags)
}

fn manifests() -> Value {
    let extension = yaml_docs(&kube_dir().join("inference-pool.yaml"));
    let find = |kind: &str| extension.iter().find(|d| d["kind"] == kind).cloned().unwrap_or_else(|| panic!("no {kind}"));
    json!({
        "deployment": doc("deployment.yaml"), "service": doc("service.yaml"), "pdb": doc("pdb.yaml"), "hpa": doc("hpa.yaml"),
        "pool": find("InferencePool"), "model": find("InferenceModel"), "entrypoint": containerfile_entrypoint(),
    })
}

#[test]
fn the_manifests_and_the_containerfile_agree() {
    let m = manifests();
    let found = problems(&m);
    assert!(found.is_empty(), "{found:#?}");
    // Each check fails on the manifest that gets it wrong.
    let cases: [(&str, fn(&mut Value)); 8] = [
        ("grace period too short", |m| m["deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = json!(30)),
        ("readiness elsewhere", |m| m["deployment"]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = json!("/")),
        ("probe port", |m| m["deployment"]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = json!(8080)),
        ("Service port", |m| m["service"]["spec"]["ports"][0]["targetPort"] = json!(8080)),
        ("PDB selector", |m| m["pdb"]["spec"]["selector"]["matchLabels"] = json!({"app": "other"})),
        ("model name", |m| m["model"]["spec"]["modelName"] = json!("SmolLM2-135M-Instruct")),
        ("pool port", |m| m["pool"]["spec"]["targetPortNumber"] = json!(9000)),
        ("Containerfile timeout", |m| m["entrypoint"]["shutdown-timeout"] = json!("60")),
    ];
    for (what, break_it) in cases {
        let mut broken = m.clone();
        break_it(&mut broken);
        assert!(!problems(&broken).is_empty(), "{what}: not caught");
    }
}

/// The Inference Extension example carries the v0.3.0 release's fields
/// (inference.networking.x-k8s.io/v1alpha2); kubernetes-validate has no schema
/// for custom resources, so the required fields and types are checked here.
#[test]
fn the_inference_extension_example_has_its_release_fields() {
    let docs = yaml_docs(&kube_dir().join("inference-pool.yaml"));
    assert_eq!(docs.len(), 2);
    for d in &docs {
        assert_eq!(d["apiVersion"], "inference.networking.x-k8s.io/v1alpha2", "{d}");
        assert!(d["metadata"]["name"].is_string());
    }
    let pool = docs.iter().find(|d| d["kind"] == "InferencePool").expect("an InferencePool");
    let spec = pool["spec"].as_object().unwrap();
    let mut keys: Vec<&str> = spec.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["extensionRef", "selector", "targetPortNumber"]);
    assert!(spec["targetPortNumber"].as_u64().is_some_and(|p| (1..65536).contains(&p)));
    assert!(spec["selector"].as_object().is_some_and(|s| !s.is_empty() && s.values().all(Value::is_string)), "selector: a label map");
    assert!(spec["extensionRef"]["name"].is_string());
    let model = docs.iter().find(|d| d["kind"] == "InferenceModel").expect("an InferenceModel");
    let spec = model["spec"].as_object().unwrap();
    for k in spec.keys() {
        assert!(["modelName", "criticality", "poolRef", "targetModels"].contains(&k.as_str()), "InferenceModel field {k}");
    }
    assert!(spec["modelName"].as_str().is_some_and(|n| !n.is_empty() && n.len() <= 253));
    assert!(["Critical", "Default", "Sheddable"].contains(&spec["criticality"].as_str().unwrap_or("Default")));
    assert!(spec["poolRef"]["name"].is_string());
}

/// A GET on loopback: (status, body).
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// deploy/build-steps.sh, the container's build, run on the host with the
/// binaries the suite has (no setup, no cargo build: the same steps otherwise),
/// then its artifact served with the Deployment's flags (host and port aside:
/// loopback, an ephemeral port; the threads the CPU limit gives), ready on
/// /health within the startup probe's budget, listing the served model, and
/// out within the grace period after SIGTERM.
#[test]
fn the_build_steps_make_an_artifact_that_serves_with_the_deployments_flags() {
    let out = temp_dir("deploy-build");
    let mef = out.as_path().join("model.mef");
    let maxrun = bin("maxrun");
    let bindir = maxrun.parent().unwrap();
    let profile = bindir.file_name().unwrap().to_str().unwrap().to_string();
    let status = Command::new(workspace_root().join("deploy/build-steps.sh"))
        .env("MAXC_SKIP_SETUP", "1")
        .env("MAXC_SKIP_BUILD", "1")
        .env("MAXC_PROFILE", &profile)
        .env("CARGO_TARGET_DIR", bindir.parent().unwrap())
        .env("MAXC_ARTIFACT_OUT", &mef)
        .env_remove("MAXC_CACHE_DIR")
        .status()
        .expect("build-steps.sh runs");
    assert!(status.success(), "deploy/build-steps.sh failed");
    assert!(std::fs::metadata(&mef).unwrap().len() > 50 << 20, "the artifact is the 94 MiB SmolLM2");

    let dep = doc("deployment.yaml");
    let c = container(&dep);
    let cpu = c["resources"]["limits"]["cpu"].as_str().unwrap().to_string();
    let mut args = container_args(&dep);
    let at = args.iter().position(|a| a.ends_with(".mef")).expect("the artifact in the args");
    args[at] = mef.to_str().unwrap().to_string();
    for a in args.iter_mut() {
        if a.starts_with("--host=") {
            *a = "--host=127.0.0.1".into();
        } else if a.starts_with("--port=") {
            *a = "--port=0".into();
        } else {
            *a = a.replace("$(MAXRUN_THREADS)", &cpu);
        }
    }
    let served = flag(&args, "served-model-name").unwrap();
    let grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap();
    let startup = &c["startupProbe"];
    let ready_within = Duration::from_secs(startup["periodSeconds"].as_u64().unwrap() * startup["failureThreshold"].as_u64().unwrap());

    let started = Instant::now();
    let mut child = Command::new(&maxrun).args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("maxrun starts");
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(at) = line.find("on http://") {
                let _ = tx.send(line[at + 10..].split_whitespace().next().unwrap_or("").trim_end_matches('/').to_string());
            }
        }
    });
    let addr = rx.recv_timeout(ready_within).unwrap_or_else(|_| {
        let _ = child.kill();
        panic!("maxrun serve {args:?} printed no address within {ready_within:?}")
    });
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let ready = loop {
        match get(&addr, "/health") {
            Some((200, _)) => break true,
            _ if started.elapsed() > ready_within => break false,
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    if !ready {
        let _ = child.kill();
        panic!("/health not ready within the startup probe's {ready_within:?}");
    }
    let (status, body) = get(&addr, "/v1/models").expect("/v1/models answers");
    let models: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{status} {body}"));
    assert_eq!(status, 200);
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, [served.as_str()], "{body}");

    // SIGTERM comes after preStop: what is left of the grace period is the drain's.
    let term = Instant::now();
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let within = Duration::from_secs(grace - pre_stop);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if term.elapsed() > within {
            let _ = child.kill();
            panic!("maxrun serve did not exit within {within:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(0));
}
