import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.pki import make_pki

# Triton reads this when a kernel is decorated, so it must be set before any kernels module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _import_installed(name: str) -> None:
    """Imports the installed package `name`, if there is one, ahead of the repository's folder of
    that name. The service folders sit at the root (pyproject.toml installs them inside
    pagedserve), which pytest puts on sys.path; transformers 5.25+ requires Hugging Face's
    `kernels` and imports it as it loads, where it would find the root's `kernels/` instead."""
    root = Path(__file__).resolve().parent.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved


_import_installed("kernels")


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """tests/pki.py's CA, other CA and their certificates for localhost (skips without openssl)."""
    return make_pki(tmp_path_factory.mktemp("pki"))
