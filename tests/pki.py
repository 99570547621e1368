"""A throwaway public-key infrastructure for TLS tests, made with the openssl command."""
import shutil
import subprocess
from pathlib import Path

import pytest


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """In `d`: a CA and another CA (ca.pem, other-ca.pem, with keys), and two certificates for
    localhost, for server and client use: service.pem signed by the CA, and stranger.pem by the
    other, which must not get in. Skips the test without the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"), "-days", "2", "-subj", f"/CN={ca}")
    for name, ca in (("service", "ca"), ("stranger", "other-ca")):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"), "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.pem"),
                "-CAkey", str(d / f"{ca}.key"), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                "-out", str(d / f"{name}.pem"))
    return d
