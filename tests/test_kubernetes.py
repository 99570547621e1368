"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate
ships them), every container's command parses with pagedserve's own parser, the gateway is given
the address of every engine Service (the chat model's, and the embedding model's and the
reranker's behind --also-serve), every pod is hardened, and only the gateway reaches the engines."""
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagedserve.entrypoints.cli import build_parser

MANIFESTS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "kubernetes").glob("*.yaml"))
DOCS = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]


def deployments() -> list[dict]:
    return [d for d in DOCS if d["kind"] == "Deployment"]


def containers() -> dict[str, dict]:
    return {f"{d['metadata']['name']}/{c['name']}": c for d in DOCS if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("name", sorted(containers()))
def test_each_command_parses(name):
    command = containers()[name]["command"]
    assert command[0] == "pagedserve"
    build_parser().parse_args(command[1:])


def test_the_gateway_lists_every_engine_service_and_each_engine_has_one_gpu():
    engines = [d for d in DOCS if d["kind"] == "Service" and d["metadata"]["labels"]["app.kubernetes.io/component"]
               == "engine"]
    gateway = build_parser().parse_args(containers()["pagedserve-gateway/gateway"]["command"][1:])
    chat = gateway.scheduler_address.split(",")
    also = [spec.options["scheduler-address"] for spec in gateway.also_serve]
    assert len(chat) >= 2 and len(also) == 2
    assert sorted(chat + also) == sorted(f"{s['metadata']['name']}:{s['spec']['ports'][0]['port']}" for s in engines)
    executors = [c for name, c in containers().items() if name.endswith("/executor")]
    assert len(executors) == len(engines)
    assert all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in executors)


def test_each_also_served_model_is_the_one_its_engine_serves():
    gateway = build_parser().parse_args(containers()["pagedserve-gateway/gateway"]["command"][1:])
    for spec in gateway.also_serve:
        name = spec.options["scheduler-address"].split(":")[0]
        for part in ("executor", "scheduler"):
            assert build_parser().parse_args(containers()[f"{name}/{part}"]["command"][1:]).model == spec.model
    assert [spec.options["served-model-name"] for spec in gateway.also_serve] == ["embed", "rerank"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("deployment", deployments(), ids=lambda d: d["metadata"]["name"])
def test_each_pod_runs_hardened_with_requests_and_limits(deployment):
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for c in pod["containers"]:
        context = pod["securityContext"] | c.get("securityContext", {})
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0, c["name"]
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
        assert context["allowPrivilegeEscalation"] is False, c["name"]
        assert context["readOnlyRootFilesystem"] is True, c["name"]
        assert context["capabilities"] == {"drop": ["ALL"]}, c["name"]
        # The one place written (Triton's cache, under HOME=/tmp in the image).
        assert any(m["mountPath"] == "/tmp" and m["name"] in tmp_volumes for m in c["volumeMounts"]), c["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
        image, _, tag = c["image"].partition(":")
        assert tag and tag != "latest", c["image"]


def test_secrets_are_required_and_every_container_gets_the_grpc_token():
    for name, c in containers().items():
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs["PAGEDSERVE_GRPC_TOKEN"] == {"name": "pagedserve", "key": "grpc-token"}, name
        assert not any(ref.get("optional") for ref in refs.values()), name
    gateway = containers()["pagedserve-gateway/gateway"]
    assert {"name": "PAGEDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "pagedserve", "key": "api-key"}}} \
        in gateway["env"]
    assert gateway["livenessProbe"]["httpGet"]["port"] == "http"


def test_a_network_policy_admits_only_the_gateway_to_the_engines():
    policies = [d for d in DOCS if d["kind"] == "NetworkPolicy"]
    engine_pods = [d["spec"]["template"]["metadata"]["labels"] for d in deployments()
                   if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    gateway_pod = next(d["spec"]["template"]["metadata"]["labels"] for d in deployments()
                       if d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway")
    engine_port = next(c["ports"][0]["containerPort"] for n, c in containers().items() if n.endswith("/scheduler"))
    for labels in engine_pods:
        covering = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert len(covering) == 1, labels
        spec = covering[0]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            assert rule["ports"] == [{"protocol": "TCP", "port": engine_port}]
            assert [set(peer) for peer in rule["from"]] == [{"podSelector"}]
            assert all(selects(peer["podSelector"], gateway_pod) for peer in rule["from"])
            assert not any(selects(peer["podSelector"], labels) for peer in rule["from"])
