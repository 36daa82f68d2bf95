//! A real Kubernetes API server for the chart's and the agent's tests: etcd and kube-apiserver
//! from `scripts/kube-control-plane.sh` (built from the Go module proxy once, cached), on
//! loopback, their state in a temp dir, stopped when dropped. Requests go through curl with the
//! server's own CA and a bearer token: the admin's (a static system:masters token) or a
//! ServiceAccount's from the TokenRequest API, so that the real authenticator and RBAC
//! authorizer decide. Tokens go to curl on its standard input, never on a command line.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::workspace_root;

/// Where the tests install the chart: its release name is also its ServiceAccount's name.
pub const CHART_NAMESPACE: &str = "observability";
pub const CHART_RELEASE: &str = "pgscope";

pub struct KubeControlPlane {
    url: String,
    dir: tempfile::TempDir,
}

/// An answer of the API server: its HTTP status and JSON body (`Value::Null` when empty).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl KubeControlPlane {
    /// Starts etcd and the API server; returns once the API server is ready.
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("pgscope-kube-").tempdir()?;
        let output = script(
            "kube-control-plane.sh",
            &["start", &dir.path().display().to_string()],
        )?;
        let url = output.trim().to_string();
        ensure!(
            url.starts_with("https://127.0.0.1:"),
            "kube-control-plane.sh printed `{url}`"
        );
        Ok(Self { url, dir })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The admin's kubeconfig (for helm).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// A kubeconfig for `token`'s user (what the agent reads through `KUBECONFIG`), in the
    /// control plane's directory, readable by its owner only.
    pub fn kubeconfig_for(&self, name: &str, token: &str) -> Result<PathBuf> {
        let path = self.dir.path().join(format!("{name}.kubeconfig"));
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    \
             certificate-authority: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: {name}\ncurrent-context: test\n",
            url = self.url,
            ca = self.ca().display(),
        );
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        file.write_all(config.as_bytes())?;
        Ok(path)
    }

    /// Stops the API server (etcd keeps the cluster's state): an outage, or half a restart.
    pub fn stop_apiserver(&self) -> Result<()> {
        script("kube-control-plane.sh", &["stop-apiserver", &self.dir_arg()]).map(drop)
    }

    /// Starts the API server again on its port; returns once it is ready.
    pub fn start_apiserver(&self) -> Result<()> {
        script("kube-control-plane.sh", &["start-apiserver", &self.dir_arg()]).map(drop)
    }

    /// The audit log's events so far (one JSON object per request, Metadata level: user, verb,
    /// resource, requestURI, stage).
    pub fn audit_events(&self) -> Result<Vec<Value>> {
        let text = std::fs::read_to_string(self.dir.path().join("audit.log"))?;
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| serde_json::from_str(line).with_context(|| format!("audit line `{line}`")))
            .collect()
    }

    fn dir_arg(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// The CA that signed the API server's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    fn admin_token(&self) -> Result<String> {
        Ok(std::fs::read_to_string(self.dir.path().join("admin.token"))?
            .trim()
            .to_string())
    }

    /// A request as `token`'s user; `path` starts with `/api` or `/apis`.
    pub fn request_as(&self, token: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Answer> {
        let body_file = tempfile::NamedTempFile::new()?;
        if let Some(body) = body {
            std::fs::write(body_file.path(), body.to_string())?;
        }
        let content_type = match method {
            "PATCH" => "application/merge-patch+json",
            _ => "application/json",
        };
        let mut config = format!(
            "header = \"Authorization: Bearer {token}\"\nheader = \"Content-Type: {content_type}\"\n"
        );
        if body.is_some() {
            config.push_str(&format!("data-binary = \"@{}\"\n", body_file.path().display()));
        }
        let mut child = Command::new("curl")
            .args(["-s", "-K", "-", "--cacert"])
            .arg(self.ca())
            .args(["-X", method, "-w", "\n%{http_code}"])
            .arg(format!("{}{path}", self.url))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running curl")?;
        child
            .stdin
            .take()
            .context("curl's stdin")?
            .write_all(config.as_bytes())?;
        let output = child.wait_with_output()?;
        ensure!(
            output.status.success(),
            "curl {method} {path}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8_lossy(&output.stdout);
        let (body, status) = text.rsplit_once('\n').context("curl printed no status")?;
        let status: u16 = status.trim().parse().context("curl's status")?;
        let body = if body.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(body).with_context(|| format!("{method} {path} answered `{body}`"))?
        };
        Ok(Answer { status, body })
    }

    /// A request as the admin that must succeed; its body.
    pub fn admin(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let answer = self.request_as(&self.admin_token()?, method, path, body)?;
        if !(200..300).contains(&answer.status) {
            bail!("{method} {path}: {} {}", answer.status, answer.body);
        }
        Ok(answer.body)
    }

    /// A token of ServiceAccount `namespace/name` from the TokenRequest API (what the kubelet
    /// mounts into its pods), valid for an hour.
    pub fn service_account_token(&self, namespace: &str, name: &str) -> Result<String> {
        let request = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        });
        let answer = self.admin(
            "POST",
            &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"),
            Some(&request),
        )?;
        answer["status"]["token"]
            .as_str()
            .map(str::to_string)
            .context("the TokenRequest answer has no token")
    }

    /// `helm install` of the repository's chart as release [`CHART_RELEASE`] in namespace
    /// [`CHART_NAMESPACE`] (created), pushing to a Pyroscope at `pyroscope_url`, with `extra`
    /// arguments (`--set …`).
    pub fn install_chart(&self, pyroscope_url: &str, extra: &[&str]) -> Result<()> {
        let url = format!("pyroscope.url={pyroscope_url}");
        let mut args = vec![
            "install",
            CHART_RELEASE,
            "helm/pgscope",
            "--namespace",
            CHART_NAMESPACE,
            "--create-namespace",
            "--set",
            &url,
        ];
        args.extend_from_slice(extra);
        self.helm(&args).map(drop)
    }

    /// Runs helm (built by `scripts/chart-tools.sh helm`, cached) against this API server as
    /// the admin; its standard output.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let helm = script("chart-tools.sh", &["helm"])?;
        let output = Command::new(helm.trim())
            .args(args)
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .current_dir(workspace_root())
            .output()
            .context("running helm")?;
        ensure!(
            output.status.success(),
            "helm {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

impl Drop for KubeControlPlane {
    fn drop(&mut self) {
        let _ = script("kube-control-plane.sh", &["stop", &self.dir_arg()]);
    }
}

/// Runs `scripts/<name>` with `args`; its standard output.
fn script(name: &str, args: &[&str]) -> Result<String> {
    let path = workspace_root().join("scripts").join(name);
    let output = Command::new(&path)
        .args(args)
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    ensure!(
        output.status.success(),
        "{name} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
