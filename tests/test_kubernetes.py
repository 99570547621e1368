"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate
ships them), every container's command parses with pagedserve's own parser, and the gateway is
given the address of every engine Service."""
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagedserve.entrypoints.cli import build_parser

MANIFESTS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "kubernetes").glob("*.yaml"))
DOCS = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]


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
    assert len(engines) >= 2
    assert gateway.scheduler_address.split(",") == [f"{s['metadata']['name']}:{s['spec']['ports'][0]['port']}"
                                                    for s in engines]
    executors = [c for name, c in containers().items() if name.endswith("/executor")]
    assert len(executors) == len(engines)
    assert all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in executors)
