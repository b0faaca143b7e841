"""The test bed's PKI, made with `cryptography`: a CA, the apiserver's serving cert, an admin
client cert and the service-account signing key pair. The apiserver's cert is valid for 127.0.0.1
and, with a real node (testbed/realnode.py), for the node IP it then listens on."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    apiserver_cert: Path
    apiserver_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path  # private, signs service-account tokens
    sa_pub: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, pub, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days)))


def generate(directory: Path, days: int = 30, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Write a fresh PKI into `directory` (created if needed). `extra_ips` are more SANs of the
    apiserver's serving cert (the real node's IP, where pods reach the API server)."""
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    p = Pki(*(d / n for n in ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key",
                              "admin.crt", "admin.key", "sa.key", "sa.pub")))

    ca_key = _key()
    ca_name = _name("sandman-testbed-ca")
    ca = (_builder(ca_name, ca_name, ca_key.public_key(), days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write_key(p.ca_key, ca_key)
    _write_cert(p.ca_cert, ca)

    def leaf(cert_path: Path, key_path: Path, subject: x509.Name, usage, san=None) -> None:
        key = _key()
        b = (_builder(subject, ca_name, key.public_key(), days)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        _write_key(key_path, key)
        _write_cert(cert_path, b.sign(ca_key, hashes.SHA256()))

    leaf(p.apiserver_cert, p.apiserver_key, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
          *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
          # 10.0.0.1 is the in-cluster `kubernetes` Service IP; named, never contacted.
          x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
          x509.DNSName("localhost"), x509.DNSName("kubernetes"),
          x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc")])
    # O=system:masters: cluster-admin through the built-in RBAC binding.
    leaf(p.admin_cert, p.admin_key, _name("sandman-admin", "system:masters"),
         ExtendedKeyUsageOID.CLIENT_AUTH)

    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(p.sa_key, sa)
    p.sa_pub.write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return p


def client_cert(p: Pki, name: str, cn: str, org: str | None = None,
                days: int = 30) -> tuple[Path, Path]:
    """A client cert signed by the test bed's CA, written next to it as <name>.crt/.key: the
    real node's kubelet (system:node:<node>, O=system:nodes, for the Node authorizer) and
    kube-proxy (system:kube-proxy, bound to system:node-proxier by the API server itself)."""
    ca_key = serialization.load_pem_private_key(p.ca_key.read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate(p.ca_cert.read_bytes())
    key = _key()
    cert = (_builder(_name(cn, org), ca.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = p.ca_cert.parent / f"{name}.crt", p.ca_cert.parent / f"{name}.key"
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path, key_path


def kubeconfig(pki: Pki, server: str, user: str = "admin",
               cert: tuple[Path, Path] | None = None) -> str:
    """A kubeconfig (YAML is a superset of this JSON) with file references, no inline secrets."""
    import json

    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "sandman-testbed",
        "clusters": [{"name": "sandman-testbed",
                      "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert[0] if cert else pki.admin_cert),
                                          "client-key": str(cert[1] if cert else pki.admin_key)}}],
        "contexts": [{"name": "sandman-testbed",
                      "context": {"cluster": "sandman-testbed", "user": user}}],
    }, indent=2)
