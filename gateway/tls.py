"""HTTPS on the REST API: vLLM's (uvicorn's) --ssl-* flags, as one server-side SSL context."""
import argparse
import ssl

from pagedserve.common.config import flags_given

# vLLM's --ssl-cert-reqs values: ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED.
CERT_REQS = (0, 1, 2)
FLAGS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")


def add_tls_args(group: argparse._ActionsContainer) -> None:
    group.add_argument("--ssl-certfile", default=None, metavar="PATH",
                       help="serve HTTPS with this PEM certificate chain (needs --ssl-keyfile)")
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the PEM private key of --ssl-certfile")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="PEM CA certificates that client certificates must chain to (see --ssl-cert-reqs)")
    group.add_argument("--ssl-cert-reqs", type=int, choices=CERT_REQS, default=0,
                       help="client certificates: 0 not asked for, 1 checked if sent, 2 required (mutual TLS)")


def server_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The SSL context of the --ssl-* flags, None without --ssl-certfile; raises ValueError, in one
    line, for flags that do not go together or files that do not load."""
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None or args.ssl_ca_certs is not None or args.ssl_cert_reqs:
            raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
        return None
    if args.ssl_keyfile is None:
        raise ValueError("--ssl-certfile needs --ssl-keyfile, the certificate's private key")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs; give it")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except OSError as e:  # ssl.SSLError among them
        raise ValueError(f"--ssl-certfile, --ssl-keyfile or --ssl-ca-certs does not load ({e}); pass PEM "
                         "files this process can read, the key matching the certificate") from None
    context.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return context


def argv(args: argparse.Namespace) -> list[str]:
    """The --ssl-* flags given, to pass on to the gateway."""
    return flags_given(args, FLAGS)
