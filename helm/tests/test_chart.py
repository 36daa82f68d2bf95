"""The Helm chart: lint, render with the default values and with every option, validate the
manifests offline against the Kubernetes schemas of a current release, and check what
matters about them: host PID namespace, the exact capabilities, no privileged container by
default, RBAC limited to reading pods, and the agent's configuration wiring.

Run by `make chart-test` (scripts/chart-tools.sh) with HELM (a helm binary) in the environment.
"""

import os
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "pgscope"
FULL_VALUES = Path(__file__).resolve().parent / "values-full.yaml"
HELM = os.environ.get("HELM", "helm")
# The current release and the oldest one the agent's API client (k8s-openapi v1_33) targets.
KUBERNETES_VERSIONS = os.environ.get("KUBERNETES_VERSIONS", "1.37.0 1.33.0").split()
REQUIRED = ["--set", "pyroscope.url=http://pyroscope.monitoring:4040"]

CAPABILITIES = ["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH", "SYS_RESOURCE", "SYSLOG", "SYS_NICE"]


def helm(*args):
    result = subprocess.run([HELM, *args], capture_output=True, text=True)
    assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result.stdout


def render(*args):
    text = helm("template", "pgscope", str(CHART), "--namespace", "observability", *args)
    docs = [d for d in yaml.safe_load_all(text) if d]
    return text, {(d["kind"], d["metadata"]["name"]): d for d in docs}


def of_kind(manifests, kind):
    found = [d for (k, _), d in manifests.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def agent_container(manifests):
    pod = of_kind(manifests, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def agent_config(manifests):
    return tomllib.loads(of_kind(manifests, "ConfigMap")["data"]["agent.toml"])


def validate(text):
    """kubernetes-validate, offline, strict (unknown fields are errors), against each version;
    the ServiceMonitor (a CRD of the Prometheus operator, not in Kubernetes' schemas) is left
    out."""
    docs = [d for d in yaml.safe_load_all(text) if d and d["kind"] != "ServiceMonitor"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump_all(docs, f)
        f.flush()
        for version in KUBERNETES_VERSIONS:
            result = subprocess.run(
                ["kubernetes-validate", "--strict", "--kubernetes-version", version, f.name],
                capture_output=True, text=True)
            assert result.returncode == 0, \
                f"schema validation against {version} failed:\n{result.stdout}\n{result.stderr}"


def test_lint_with_default_and_full_values():
    helm("lint", "--strict", str(CHART), *REQUIRED)
    helm("lint", "--strict", str(CHART), "-f", str(FULL_VALUES))


def test_the_pyroscope_url_is_required():
    result = subprocess.run([HELM, "template", "pgscope", str(CHART)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "pyroscope.url is required" in result.stderr


def test_default_manifests_are_valid_and_least_privilege():
    text, manifests = render(*REQUIRED)
    validate(text)
    pod, container = agent_container(manifests)
    assert pod["hostPID"] is True
    security = container["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["runAsUser"] == 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["capabilities"]["add"] == CAPABILITIES
    assert "SYS_ADMIN" not in security["capabilities"]["add"]
    # Health endpoints wired to the agent's.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/sys/kernel/tracing"]["readOnly"] is True
    assert "/etc/pgscope" in mounts
    assert container["args"] == ["agent", "--config", "/etc/pgscope/agent.toml"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PGSCOPE_PYROSCOPE_URL"]["value"] == "http://pyroscope.monitoring:4040"
    assert env["PGSCOPE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "PGSCOPE_PYROSCOPE_PASSWORD" not in env, "no credentials configured, none referenced"
    # /metrics on the pod's IP, not 0.0.0.0; probes reach it there through the named port.
    assert env["PGSCOPE_METRICS_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9437, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert "0.0.0.0" not in text, "nothing binds every interface"
    # No ServiceMonitor (CRD) unless asked for; no Secret without credentials.
    assert not any(k == "ServiceMonitor" for k, _ in manifests)
    assert not any(k == "Secret" for k, _ in manifests)


def test_rbac_only_reads_pods():
    _, manifests = render(*REQUIRED)
    role = of_kind(manifests, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = of_kind(manifests, "ClusterRoleBinding")
    account = of_kind(manifests, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "observability"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod, _ = agent_container(manifests)
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_default_config_is_what_the_agent_defaults_to():
    _, manifests = render(*REQUIRED)
    config = agent_config(manifests)
    assert config["collection"] == {
        "frequency": 19, "upload_interval": "15s", "off_cpu": "sampled",
        "off_cpu_min_stack": "100us", "off_cpu_idle": False}
    assert config["labels"] == {
        "service_name": "postgres/{instance}", "pid": False, "pod_service_name": True,
        "top_queryids": 100, "max_series": 1000, "query_text": True,
        "statement_detail": False}
    assert config["discovery"] == {"include": [], "exclude": []}
    assert config["server"] == {"metrics_addr": "127.0.0.1:9437", "log_format": "json"}


def test_every_option_is_wired():
    text, manifests = render("-f", str(FULL_VALUES))
    validate(text)
    pod, container = agent_container(manifests)
    assert container["image"] == "registry.example.com/pgscope:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert container["securityContext"]["capabilities"]["add"] == CAPABILITIES + ["SYS_ADMIN"]
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"}
    assert pod["nodeSelector"] == {"node-role.kubernetes.io/database": ""}
    assert pod["tolerations"][0]["value"] == "postgres"
    assert pod["affinity"]["nodeAffinity"]
    assert pod["priorityClassName"] == "system-node-critical"
    template = of_kind(manifests, "DaemonSet")["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "dba"
    assert template["metadata"]["annotations"]["example.com/team"] == "dba"
    assert "checksum/config" in template["metadata"]["annotations"]
    assert of_kind(manifests, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 2
    account = of_kind(manifests, "ServiceAccount")
    assert account["metadata"]["name"] == "pgscope-agent"
    assert account["metadata"]["annotations"] == {"example.com/role": "profiler"}

    config = agent_config(manifests)
    assert config["pyroscope"] == {"timeout": "5s", "queue_max_bytes": 33554432, "ca_file": "/etc/pgscope/ca/ca.pem"}
    assert config["collection"] == {
        "frequency": 49, "upload_interval": "10s", "off_cpu": "exact",
        "off_cpu_min_stack": "1ms", "off_cpu_idle": True}
    assert config["labels"] == {
        "service_name": "pg/{instance}", "pid": True, "pod_service_name": False,
        "top_queryids": 20, "max_series": 300, "query_text": False, "statement_detail": True,
        "static": {"env": "prod", "region": "eu-west-1"}}
    assert config["discovery"] == {
        "include": [{"data_dir": "/var/lib/postgresql/data", "port": 5432}],
        "exclude": [{"binary": "/usr/lib/postgresql/13/bin/postgres"}]}
    assert config["server"] == {"metrics_addr": "127.0.0.1:9500", "log_format": "text"}

    # Credentials: a Secret, referenced key by key.
    secret = of_kind(manifests, "Secret")
    assert secret["stringData"] == {"username": "agent", "password": "s3cret", "tenant": "team-a"}
    env = {e["name"]: e for e in container["env"]}
    assert env["PGSCOPE_PYROSCOPE_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": "password", "optional": True}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/etc/pgscope/ca" in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["ca"]["configMap"]["name"] == "corp-ca"
    assert container["ports"][0]["containerPort"] == 9500

    monitor = of_kind(manifests, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    service = of_kind(manifests, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9500, "targetPort": "metrics"}]
    assert "0.0.0.0" not in text


def test_an_existing_secret_replaces_the_rendered_one():
    _, manifests = render(*REQUIRED, "--set", "pyroscope.existingSecret=pyroscope-creds",
                          "--set", "pyroscope.basicAuth.username=ignored")
    assert not any(k == "Secret" for k, _ in manifests)
    _, container = agent_container(manifests)
    env = {e["name"]: e for e in container["env"]}
    assert env["PGSCOPE_PYROSCOPE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "pyroscope-creds"


@pytest.mark.parametrize("given,rendered", [("true", "sampled"), ("false", "none"), ("none", "none")])
def test_off_cpu_takes_a_mode_or_the_booleans_of_earlier_charts(given, rendered):
    _, manifests = render(*REQUIRED, "--set", f"collection.offCpu={given}")
    assert agent_config(manifests)["collection"]["off_cpu"] == rendered


def test_privileged_switch_for_old_kernels():
    text, manifests = render(*REQUIRED, "--set", "privileged=true")
    validate(text)
    _, container = agent_container(manifests)
    assert container["securityContext"]["privileged"] is True
    assert "capabilities" not in container["securityContext"]


@pytest.mark.parametrize("values", [None, FULL_VALUES])
def test_the_rendered_config_passes_the_agents_own_check(values, tmp_path):
    """The agent validates the ConfigMap's TOML exactly as it will in the pod."""
    args = ["-f", str(values)] if values else list(REQUIRED)
    _, manifests = render(*args)
    path = tmp_path / "agent.toml"
    path.write_text(of_kind(manifests, "ConfigMap")["data"]["agent.toml"])
    ca = tmp_path / "ca.pem"
    text = path.read_text()
    if "ca_file" in text:
        # The CA ConfigMap is mounted in the pod; here a real file stands in for it.
        ca.write_text(Path("/etc/ssl/certs/ca-certificates.crt").read_text())
        path.write_text(text.replace("/etc/pgscope/ca/ca.pem", str(ca)))
    pgscope = os.environ.get("PGSCOPE_BIN", str(CHART.parent.parent / "target/debug/pgscope"))
    # The pod's IP as the downward API gives it: the agent serves there, on the chart's port.
    result = subprocess.run(
        [pgscope, "agent", "--check-config", "--config", str(path)],
        env={**os.environ, "PGSCOPE_PYROSCOPE_URL": "http://pyroscope.monitoring:4040",
             "PGSCOPE_METRICS_ADDR": "10.244.1.17"},
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    port = agent_config(manifests)["server"]["metrics_addr"].rsplit(":", 1)[1]
    assert f"server: 10.244.1.17:{port}," in result.stdout, result.stdout


ROOT = CHART.parent.parent


def test_the_dockerfile_lints_clean():
    result = subprocess.run(["hadolint", "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_builds_what_the_makefile_builds():
    """The image runs `make release`, the Makefile's build optimised, with the same BPF
    toolchain packages that scripts/install-deps.sh installs."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "RUN make release" in dockerfile
    assert "release:\n\t$(CARGO) build --locked --release -p pgscope-agent\n" \
        "\tscripts/split-debug.sh target/release/pgscope target/release/dist\n" in makefile
    # The default image gets the binary without its DWARF; the `debug` stage adds it where the
    # binary's debug link finds it.
    assert "COPY --from=build /src/target/release/dist/pgscope /usr/local/bin/pgscope" in dockerfile
    assert ("COPY --from=build /src/target/release/dist/pgscope.debug "
            "/usr/lib/debug/usr/local/bin/pgscope.debug") in dockerfile
    assert dockerfile.rstrip().endswith("FROM runtime"), "the default image is not the runtime stage"
    deps = (ROOT / "scripts/install-deps.sh").read_text()
    for package in ["clang", "llvm", "libbpf-dev", "bpftool", "build-essential", "pkg-config"]:
        assert f" {package}" in dockerfile, package
        assert package in deps, package


def test_the_image_binary_ships_without_its_debug_info_and_still_finds_it(tmp_path):
    """`make release` splits the binary's DWARF off (scripts/split-debug.sh): the binary keeps
    its code and symbol table and names its debug file in a .gnu_debuglink, through which gdb
    still gives a function's file and line. Done here on the binary under test (the debug
    build: the same sections, more of them)."""
    pgscope = Path(os.environ.get("PGSCOPE_BIN", str(ROOT / "target/debug/pgscope")))
    binary = tmp_path / "pgscope"
    binary.write_bytes(pgscope.read_bytes())
    binary.chmod(0o755)
    dist = tmp_path / "dist"
    subprocess.run([str(ROOT / "scripts/split-debug.sh"), str(binary), str(dist)], check=True,
                   capture_output=True, text=True)
    stripped, debug = dist / "pgscope", dist / "pgscope.debug"
    sections = run_out(["readelf", "-SW", str(stripped)])
    assert ".text" in sections and ".symtab" in sections, sections
    assert ".debug_info" not in sections and ".debug_line" not in sections, sections
    assert ".debug_info" in run_out(["readelf", "-SW", str(debug)])
    assert stripped.stat().st_size < binary.stat().st_size / 2, (stripped.stat().st_size, binary.stat().st_size)
    # The link is the file's name, then its CRC: bytes, not text.
    link = subprocess.run(["readelf", "--string-dump=.gnu_debuglink", str(stripped)],
                          capture_output=True, check=True).stdout
    assert b"pgscope.debug" in link, link
    line = run_out(["gdb", "-batch", "-ex", "info line pgscope::main", str(stripped)])
    assert 'of "agent/src/main.rs"' in line, line
    # Without the debug file the binary still runs.
    debug.unlink()
    assert run_out([str(stripped), "--version"]).startswith("pgscope"), "the stripped binary does not run"


def test_the_binary_runs_on_a_bookworm_slim_root(tmp_path):
    """The image copies the binary onto debian:bookworm-slim: debootstrap's minbase, i.e.
    Debian's `Priority: required` packages, apt, and what they depend on. No container engine
    here: every library `ldd` lists must come from a package of that set (computed from this
    machine's bookworm package index), and the binary must run in a root holding nothing but
    itself and those libraries. (The Makefile's binary links the same libraries as `make
    release`'s: the profile changes code, not what is linked.)"""
    pgscope = Path(os.environ.get("PGSCOPE_BIN", str(ROOT / "target/debug/pgscope")))
    ldd = subprocess.run(["ldd", str(pgscope)], capture_output=True, text=True, check=True).stdout
    libraries = []
    for line in ldd.splitlines():
        fields = line.split()
        if "=>" in fields:
            libraries.append(fields[fields.index("=>") + 1])
        elif fields and fields[0].startswith("/"):
            libraries.append(fields[0])  # the dynamic loader
    assert libraries, ldd
    packages = {}
    for library in libraries:
        # Debian 12 merged /lib into /usr/lib: dpkg knows a file by the path its package ships.
        candidates = [library, "/usr" + library, str(Path(library).resolve())]
        owner = next((run_out(["dpkg", "-S", c]) for c in candidates if run_out(["dpkg", "-S", c])), "")
        assert owner, f"no package owns {library}"
        packages[library] = owner.split(":")[0]
    base = minbase_packages()
    assert len(base) > 50, f"the package index gives a minbase of {len(base)} packages"
    outside = {lib: pkg for lib, pkg in packages.items() if pkg not in base}
    assert not outside, f"libraries from packages bookworm-slim does not have: {outside}"

    root = tmp_path / "root"
    for library in libraries:
        target = root / library.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(Path(library).resolve().read_bytes())
        target.chmod(0o755)
    (root / "pgscope").write_bytes(pgscope.read_bytes())
    (root / "pgscope").chmod(0o755)
    result = subprocess.run(["unshare", "--map-root-user", "chroot", str(root), "/pgscope", "--version"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("pgscope "), result.stderr
    print(f"image: {' '.join(sorted(set(packages.values())))} (in bookworm-slim's {len(base)} packages); "
          f"runs alone: {result.stdout.strip()}")


def minbase_packages():
    """`Priority: required` packages and apt, with their dependencies (first alternatives,
    as debootstrap takes them), from `apt-cache dumpavail`."""
    index = {}
    for stanza in run_out(["apt-cache", "dumpavail"]).split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if ": " in line and not line.startswith(" "):
                key, value = line.split(": ", 1)
                fields[key] = value
        if "Package" in fields:
            depends = ", ".join(filter(None, [fields.get("Pre-Depends"), fields.get("Depends")]))
            first = [d.split("|")[0].split("(")[0].split(":")[0].strip() for d in depends.split(",") if d.strip()]
            index[fields["Package"]] = (fields.get("Priority"), first)
    todo = [name for name, (priority, _) in index.items() if priority == "required"] + ["apt"]
    base = set()
    while todo:
        name = todo.pop()
        if name in base or name not in index:
            continue
        base.add(name)
        todo.extend(index[name][1])
    return base


def run_out(command):
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""
