"""``edgetrain certs``: the certificates and keys of a Flower fleet with TLS and SuperNode authentication.

``certs make`` writes a private CA, the SuperLink's certificate (its addresses and names as subject
alternative names) and one EC key pair per SuperNode in OpenSSH format, the form
``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read. ``certs check`` says
before anything starts whether a certificate, its key, the CA and an address agree, in one line each way.
Made with ``cryptography`` (installed with asyncssh). The recipe: docs/tutorials/raspberry-pi-cluster.md.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import shutil
import tempfile
from pathlib import Path

from edgetrain.arguments import positive_int
from edgetrain.errors import EdgetrainError

# Imported inside functions: cryptography (installed with asyncssh, the ssh extra; _crypto says so in one line).

CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.crt", "server.key"
VALID_DAYS = 825  # what browsers and most TLS clients accept for a leaf certificate
HOST_NAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:  # one line through the CLI, not a traceback
        raise EdgetrainError("edgetrain certs needs the cryptography package, which is not installed; "
                             "pip install edgetrain[ssh] (or pip install cryptography)") from None
    return x509, hashes, serialization, ec


def parse_hosts(text: str) -> list[str]:
    """``10.0.0.1,pi0.local``: the SuperLink's addresses and host names, as its certificate names them."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise EdgetrainError("--hosts names no host; give the SuperLink's address(es) as the SuperNodes reach it, "
                             "e.g. --hosts 192.168.1.10,pi0.local")
    for host in hosts:
        if not (_is_ip(host) or HOST_NAME.match(host)):
            raise EdgetrainError(f"--hosts {host!r} is neither an IP address nor a host name; give the address "
                                 f"the SuperNodes use in --superlink, e.g. 192.168.1.10")
    return hosts


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _name(common_name: str):
    x509 = _crypto()[0]
    return x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, public_key, issuer: str, signing_key, days: int, extensions):
    x509, hashes, _, _ = _crypto()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def make_files(hosts: list[str], nodes: int, days: int = VALID_DAYS) -> dict[str, tuple[bytes, bool]]:
    """Every file of a fleet, by name: its bytes and whether it is secret (written readable by its owner only)."""
    x509, _, serialization, ec = _crypto()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("edgetrain fleet CA", ca_key.public_key(), "edgetrain fleet CA", ca_key, days,
                      [(x509.BasicConstraints(ca=True, path_length=0), True),
                       (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                      content_commitment=False, key_encipherment=False, data_encipherment=False,
                                      key_agreement=False, encipher_only=False, decipher_only=False), True)])
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    server = _certificate(hosts[0], server_key.public_key(), "edgetrain fleet CA", ca_key, days,
                          [(x509.SubjectAlternativeName(names), False),
                           (x509.BasicConstraints(ca=False, path_length=None), True),
                           (x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    pem, openssh = serialization.Encoding.PEM, serialization.Encoding.OpenSSH
    no_password = serialization.NoEncryption()
    files = {CA_CERT: (ca.public_bytes(pem), False),
             CA_KEY: (ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_password), True),
             SERVER_CERT: (server.public_bytes(pem), False),
             SERVER_KEY: (server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_password), True)}
    for i in range(nodes):  # Flower's SuperNode keys: a NIST EC curve, OpenSSH format
        key = ec.generate_private_key(ec.SECP384R1())
        files[f"node-{i}.key"] = (key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, no_password), True)
        files[f"node-{i}.pub"] = (key.public_key().public_bytes(openssh, serialization.PublicFormat.OpenSSH)
                                  + f" edgetrain-node-{i}\n".encode(), False)
    return files


def write_new_directory(out: Path, files: dict[str, tuple[bytes, bool]]) -> None:
    """All the files in ``out`` or none: written in a directory beside it, renamed into place at the end. ``out``
    must not exist or be empty, so a CA is never overwritten (every SuperNode trusts the one it has)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EdgetrainError(f"--out {out} already exists and is not an empty directory; give a new directory "
                             f"(a fleet's CA is never overwritten: every SuperNode trusts the one it has)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise EdgetrainError(f"--out {out}: its parent directory {parent} does not exist; create it first or give "
                             f"another path")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for name, (data, secret) in files.items():
            path = staging / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        staging.chmod(0o755)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _read(path: str, flag: str, what: str) -> bytes:
    file = Path(path).expanduser()
    if not file.is_file():
        problem = "is a directory" if file.is_dir() else "does not exist"
        raise EdgetrainError(f"{flag} {path} {problem}; give {what} (edgetrain certs make writes it)")
    return file.read_bytes()


def _load_certificate(path: str, flag: str, what: str):
    x509 = _crypto()[0]
    try:
        return x509.load_pem_x509_certificate(_read(path, flag, what))
    except ValueError:
        raise EdgetrainError(f"{flag} {path} is not a PEM certificate; give {what} "
                             f"(edgetrain certs make writes it)") from None


def _load_private_key(path: str, flag: str, what: str):
    serialization = _crypto()[2]
    from cryptography.exceptions import UnsupportedAlgorithm

    data = _read(path, flag, what)
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            return serialization.load_ssh_private_key(data, None)
        return serialization.load_pem_private_key(data, None)
    except TypeError:
        raise EdgetrainError(f"{flag} {path} is protected by a password; give a key without one, as the SuperLink "
                             f"and SuperNode read it unattended") from None
    except (ValueError, UnsupportedAlgorithm):
        raise EdgetrainError(f"{flag} {path} is not a private key; give {what} "
                             f"(edgetrain certs make writes it)") from None


def _same_public_key(a, b) -> bool:
    serialization = _crypto()[2]
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return a.public_bytes(der, spki) == b.public_bytes(der, spki)


def check_server(ca_path: str, cert_path: str, key_path: str, host: str | None) -> str:
    """Whether the SuperLink's certificate, its key, the CA the SuperNodes trust and ``host`` agree; what was
    checked, in one line, else one ``EdgetrainError`` line with the fix."""
    from cryptography.exceptions import InvalidSignature

    ca = _load_certificate(ca_path, "--ca", "the CA certificate (ca.crt)")
    cert = _load_certificate(cert_path, "--cert", "the SuperLink's certificate (server.crt)")
    key = _load_private_key(key_path, "--key", "the SuperLink's key (server.key)")
    if not _same_public_key(key.public_key(), cert.public_key()):
        raise EdgetrainError(f"--key {key_path} is not the key of --cert {cert_path}; give the key made with that "
                             f"certificate (server.key beside it)")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):  # another issuer's name, key type or signature
        raise EdgetrainError(f"--cert {cert_path} is not signed by --ca {ca_path}; SuperNodes given that CA "
                             f"would refuse the SuperLink: give the ca.crt made with the certificate") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    for path, c in ((ca_path, ca), (cert_path, cert)):
        if not c.not_valid_before_utc <= now <= c.not_valid_after_utc:
            raise EdgetrainError(f"{path} is valid from {c.not_valid_before_utc:%Y-%m-%d} to "
                                 f"{c.not_valid_after_utc:%Y-%m-%d}, not now; make new ones with edgetrain certs make "
                                 f"(or check this machine's clock)")
    names = _alternative_names(cert)
    if host is not None and host not in names:
        raise EdgetrainError(f"--cert {cert_path} names {', '.join(names) or 'no host'}, not {host}; SuperNodes "
                             f"reaching the SuperLink at {host} would refuse it: make the certificate with "
                             f"--hosts {','.join([*names, host])}")
    return (f"{cert_path} ({', '.join(names)}) is signed by {ca_path}, matches {key_path} and is valid until "
            f"{cert.not_valid_after_utc:%Y-%m-%d}")


def _alternative_names(cert) -> list[str]:
    x509 = _crypto()[0]
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n) for n in sans.get_values_for_type(x509.IPAddress)] + sans.get_values_for_type(x509.DNSName)


def check_node_key(path: str) -> str:
    """Whether ``path`` is a SuperNode key Flower accepts (an EC key on a NIST curve, OpenSSH format)."""
    ec = _crypto()[3]
    data = _read(path, "--node-key", "a SuperNode's private key (node-I.key)")
    if b"OPENSSH PRIVATE KEY" not in data:
        raise EdgetrainError(f"--node-key {path} is not an OpenSSH private key, which flower-supernode "
                             f"--auth-supernode-private-key needs; give node-I.key from edgetrain certs make")
    key = _load_private_key(path, "--node-key", "a SuperNode's private key (node-I.key)")
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in ("secp256r1", "secp384r1",
                                                                                  "secp521r1"):
        raise EdgetrainError(f"--node-key {path} is not an EC key on a NIST curve, which Flower's SuperNode "
                             f"authentication needs; give node-I.key from edgetrain certs make")
    return f"{path} is a SuperNode key ({key.curve.name})"


def make(args: argparse.Namespace) -> int:
    hosts = parse_hosts(args.hosts)
    out = Path(args.out).expanduser()
    write_new_directory(out, make_files(hosts, args.nodes))
    print(f"edgetrain certs: {out}: {CA_CERT} (every SuperNode and flwr), {SERVER_CERT} and {SERVER_KEY} "
          f"(the SuperLink, for {', '.join(hosts)}), node-I.key (SuperNode I) and node-I.pub (flwr supernode "
          f"register), I = 0..{args.nodes - 1}; keep {CA_KEY} off the devices")
    return 0


def check(args: argparse.Namespace) -> int:
    if not (args.cert or args.node_key):
        raise EdgetrainError("certs check was given nothing to check; give --ca, --cert and --key (the SuperLink's) "
                             "and/or --node-key (a SuperNode's)")
    if args.cert or args.key or args.ca:
        missing = [flag for flag, value in (("--ca", args.ca), ("--cert", args.cert), ("--key", args.key)) if not value]
        if missing:
            raise EdgetrainError(f"certs check of the SuperLink's certificate needs {' and '.join(missing)} too; "
                                 f"give --ca ca.crt --cert server.crt --key server.key")
        print(f"edgetrain certs: ok: {check_server(args.ca, args.cert, args.key, args.host)}")
    if args.node_key:
        print(f"edgetrain certs: ok: {check_node_key(args.node_key)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("certs", help="certificates and keys for a Flower fleet with TLS and SuperNode authentication",
                       description="Make or check the CA, the SuperLink's certificate and the SuperNodes' keys of a "
                                   "Flower fleet (docs/tutorials/raspberry-pi-cluster.md).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = actions.add_parser("make", help="a new CA, the SuperLink's certificate and key, and N SuperNode key pairs")
    m.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory for the files")
    m.add_argument("--hosts", required=True, metavar="A,B",
                   help="the SuperLink's addresses and host names, as the SuperNodes and flwr reach it")
    m.add_argument("--nodes", type=positive_int, default=1, help="SuperNode key pairs to make")
    m.set_defaults(func=make)
    c = actions.add_parser("check", help="whether a certificate, its key, the CA and an address agree")
    c.add_argument("--ca", metavar="FILE", help="the CA certificate the SuperNodes trust (ca.crt)")
    c.add_argument("--cert", metavar="FILE", help="the SuperLink's certificate (server.crt)")
    c.add_argument("--key", metavar="FILE", help="the SuperLink's private key (server.key)")
    c.add_argument("--host", metavar="ADDRESS", help="the address the SuperNodes reach the SuperLink at")
    c.add_argument("--node-key", metavar="FILE", help="a SuperNode's private key (node-I.key)")
    c.set_defaults(func=check)
