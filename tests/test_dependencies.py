"""The dependency floors and the image's lock against known advisories: an offline stand-in for
pip-audit, whose vulnerability sources (PyPI's per-version JSON, OSV) CI cannot reach. FIXED is the
security review's table (docs/security-review.md §4); a new advisory means a new row here, a higher
floor in pyproject.toml and `make lock`."""
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# package -> (the first version past every advisory the review found, the advisories)
FIXED = {
    "jinja2": ("3.1.6", "sandbox escapes CVE-2024-56201, CVE-2024-56326 (<3.1.5), CVE-2025-27516 (<3.1.6)"),
    "aiohttp": ("3.14.4", "decompression bomb and chunked-body CPU (<3.13.3); parser smuggling "
                          "CVE-2026-111750 (<3.14.4)"),
    "protobuf": ("6.33.5", "CVE-2025-4565 (6.31.0), CVE-2026-0994 in json_format (<6.33.5)"),
    "torch": ("2.6", "CVE-2025-32434 in torch.load (<2.6), which pagedserve never calls: hygiene"),
}
# The image's platform, where markers decide which dependencies it installs.
IMAGE = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
         "python_version": "3.12", "python_full_version": "3.12.0", "os_name": "posix",
         "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def dependencies() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(d) for d in project["dependencies"]]


def floor(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    return max(bounds) if bounds else None


def lock() -> dict[str, tuple[Version, list[str]]]:
    """requirements.lock: name -> (pinned version, its hashes)."""
    pinned: dict[str, tuple[Version, list[str]]] = {}
    name = None
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line):
            name = canonicalize_name(match[1])
            pinned[name] = (Version(match[2]), [])
        elif match := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line):
            pinned[name][1].append(match[1])
    return pinned


@pytest.mark.parametrize("package", sorted(FIXED))
def test_the_floor_and_the_lock_are_past_every_known_fix(package):
    fixed, advisories = FIXED[package]
    requirement = next(r for r in dependencies() if canonicalize_name(r.name) == package)
    assert floor(requirement) >= Version(fixed), f"pyproject.toml admits {package} < {fixed}: {advisories}"
    assert lock()[package][0] >= Version(fixed), f"requirements.lock pins {package} < {fixed}: {advisories}"


def test_the_lock_pins_every_dependency_of_the_image_within_its_range_with_hashes():
    pinned = lock()
    assert all(hashes for _, hashes in pinned.values()), "every pin carries its hashes (--require-hashes)"
    for requirement in dependencies():
        if requirement.marker is not None and not requirement.marker.evaluate(IMAGE):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is missing from requirements.lock: run make lock"
        assert requirement.specifier.contains(pinned[name][0], prereleases=True), \
            f"requirements.lock pins {name} {pinned[name][0]} outside {requirement.specifier}: run make lock"


def test_protobuf_and_grpcio_floors_cover_the_generated_modules():
    """pagedserve/v1's modules refuse a runtime older than the protobuf and grpcio that made them."""
    generated = (ROOT / "pagedserve" / "v1" / "engine_pb2.py").read_text()
    stub = (ROOT / "pagedserve" / "v1" / "engine_pb2_grpc.py").read_text()
    protobuf = Version(re.search(r"# Protobuf Python Version: (\S+)", generated)[1])
    grpcio = Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", stub)[1])
    floors = {canonicalize_name(r.name): floor(r) for r in dependencies()}
    assert floors["protobuf"] >= protobuf and floors["grpcio"] >= grpcio


def test_the_image_installs_only_from_the_lock_with_hashes():
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if re.search(r"\bpip install\b", line)]
    assert any("--require-hashes" in line and "requirements.lock" in line for line in installs)
    # The project itself goes in without resolving anything: its dependencies came from the lock.
    assert all("--require-hashes" in line or "--no-deps" in line for line in installs), installs
