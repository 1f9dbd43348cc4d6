"""edgetrain certs: a Flower fleet's CA, SuperLink certificate and SuperNode keys, and the check of them; bad
input is one line, exit 2, nothing written. The fleet on them: tests/cluster/test_hosts.py (Flower recipe)."""
import ipaddress
import stat

import pytest

from edgetrain.cli import main
from test_bad_input import assert_one_line_error, run_main

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402


@pytest.fixture(scope="module")
def fleets(tmp_path_factory):
    """Two fleets' files: ``a`` for 10.213.0.1 and pi0.local with 2 SuperNodes, ``b`` a stranger's."""
    root = tmp_path_factory.mktemp("certs")
    assert main(["certs", "make", "--out", str(root / "a"), "--hosts", "10.213.0.1,pi0.local", "--nodes", "2"]) == 0
    assert main(["certs", "make", "--out", str(root / "b"), "--hosts", "10.213.0.1"]) == 0
    return root


def test_make_writes_a_ca_a_server_certificate_for_the_hosts_and_node_keys_flower_reads(fleets):
    a = fleets / "a"
    assert sorted(p.name for p in a.iterdir()) == ["ca.crt", "ca.key", "node-0.key", "node-0.pub", "node-1.key",
                                                   "node-1.pub", "server.crt", "server.key"]
    assert {p.name for p in a.iterdir() if stat.S_IMODE(p.stat().st_mode) == 0o600} == {
        "ca.key", "server.key", "node-0.key", "node-1.key"}
    ca = x509.load_pem_x509_certificate((a / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((a / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.213.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["pi0.local"]
    # what flower-supernode --auth-supernode-private-key and flwr supernode register load
    key = serialization.load_ssh_private_key((a / "node-0.key").read_bytes(), None)
    public = serialization.load_ssh_public_key((a / "node-0.pub").read_bytes())
    assert key.curve.name == "secp384r1" and key.public_key().public_numbers() == public.public_numbers()


def test_check_says_what_agrees(fleets, capsys):
    a = fleets / "a"
    assert main(["certs", "check", "--ca", str(a / "ca.crt"), "--cert", str(a / "server.crt"), "--key",
                 str(a / "server.key"), "--host", "pi0.local", "--node-key", str(a / "node-1.key")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "(10.213.0.1, pi0.local) is signed by" in out[0] and "secp384r1" in out[1], out


BAD = [
    (["make", "--out", "{tmp}/new", "--hosts", "10.213.0.1,not a host"], "is neither an IP address nor a host name"),
    (["make", "--out", "{tmp}/new", "--hosts", " , "], "--hosts names no host"),
    (["make", "--out", "{a}", "--hosts", "10.213.0.1"], "already exists and is not an empty directory"),
    (["make", "--out", "{tmp}/no/such/dir", "--hosts", "10.213.0.1"], "its parent directory"),
    (["make", "--out", "{tmp}/new", "--hosts", "10.213.0.1", "--nodes", "0"], "argument --nodes: must be >= 1"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{tmp}/missing.crt", "--key", "{a}/server.key"],
     "--cert {tmp}/missing.crt does not exist"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.crt", "--key", "{b}/server.key"],
     "is not the key of --cert"),
    (["check", "--ca", "{b}/ca.crt", "--cert", "{a}/server.crt", "--key", "{a}/server.key"], "is not signed by --ca"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.crt", "--key", "{a}/server.key", "--host", "10.213.0.9"],
     "names 10.213.0.1, pi0.local, not 10.213.0.9"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.key", "--key", "{a}/server.key"], "is not a PEM certificate"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.crt", "--key", "{a}/ca.crt"], "is not a private key"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.crt", "--key", "{a}"], "is a directory"),
    (["check", "--ca", "{a}/ca.crt", "--cert", "{a}/server.crt"], "needs --key too"),
    (["check", "--node-key", "{a}/server.key"], "is not an OpenSSH private key"),
    (["check", "--node-key", "{a}/node-0.pub"], "is not an OpenSSH private key"),
    (["check"], "was given nothing to check"),
]


@pytest.mark.parametrize("argv,expected", BAD, ids=[e[:40] for _, e in BAD])
def test_bad_input_is_one_line_and_writes_nothing(fleets, tmp_path, capsys, argv, expected):
    paths = {"tmp": tmp_path, "a": fleets / "a", "b": fleets / "b"}
    code, err = run_main(["certs", *[x.format(**paths) for x in argv]], capsys)
    assert_one_line_error(code, err, expected.format(**paths))
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.*"))


def test_a_password_protected_key_is_refused_in_one_line(fleets, tmp_path, capsys):
    key = serialization.load_pem_private_key((fleets / "a" / "server.key").read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    a = fleets / "a"
    code, err = run_main(["certs", "check", "--ca", str(a / "ca.crt"), "--cert", str(a / "server.crt"), "--key",
                          str(locked)], capsys)
    assert_one_line_error(code, err, "is protected by a password")
