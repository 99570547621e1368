import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    run = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "compose.yaml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_wires_three_services_by_health():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert set(services) == {"gateway", "scheduler", "executor"}
    gpu = services["executor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["scheduler"]["depends_on"]["executor"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for name, svc in services.items():
        assert svc["healthcheck"]["test"][:3] == ["CMD", "pagedserve", "probe"], name
        assert any(v.endswith(":/models:ro") for v in svc["volumes"]), name
    assert services["gateway"]["ports"] == ["${PORT:-8000}:8000"]
