"""The webhook's CA and serving certificate, made with `cryptography` (never Helm's genCA, which
mints a new CA on every upgrade and breaks admission until every replica restarts).

Rotation follows Kyverno's order so admission never breaks:
1. a new CA is put first in the bundle, the old CAs stay while they are valid;
2. the bundle is patched into both webhook configurations (caBundle);
3. only then is a serving certificate signed by the new CA issued (after a propagation wait).
At every moment the bundle the API server trusts holds the CA of every serving certificate that
a replica may still present. Expired CAs leave the bundle on a later run.

Storage: Secret `<name>-ca` (ca.crt: the bundle, newest first; ca.key: the current CA's key) and
Secret `<name>` (kubernetes.io/tls: tls.crt, tls.key, ca.crt), which the webhook pods mount;
the server reloads the files when the kubelet updates them. `ensure` is idempotent: run it before
the webhook starts and on a schedule (daily is plenty with the default lifetimes).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("webhook.certs")

CA_DAYS = 365
LEAF_DAYS = 90
RENEW_FRACTION = 3  # renew when less than a third of the lifetime is left (Kyverno-like margin)
_BACKDATE = datetime.timedelta(minutes=5)  # tolerate clock skew between nodes


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str = "sandman-webhook-ca", days: int = CA_DAYS) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    # A unique subject per CA, so a bundle holding old and new CAs is unambiguous.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"{common_name} {_now().strftime('%Y%m%dT%H%M%S.%f')}")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def new_serving(ca_cert_pem: bytes, ca_key_pem: bytes, dns_names: list[str],
                ip_addresses: Sequence[str] = (), days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cn = (list(dns_names) + list(ip_addresses) + ["sandman-webhook"])[0]
    now = _now()
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            # A CA key that cannot sign (DH, X25519, X448) fails in sign(): ours is EC (new_ca).
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)  # type: ignore[arg-type]
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def load_pair(context, cert_path: str, key_path: str) -> x509.Certificate:
    """Load a PEM pair into a live server SSLContext, or raise and leave it as it was.

    OpenSSL installs the certificate before it checks the key: a failed `load_cert_chain`
    (a torn write: new certificate, old key) leaves the context holding a certificate without
    its key, and every later handshake fails. So the pair is read once, loaded into a throwaway
    context first, and only then into the live one, from the same bytes (anonymous in-memory
    files: load_cert_chain takes paths, and the root filesystem is read-only). Returns the leaf.
    """
    import ssl

    with open(cert_path, "rb") as f:
        cert_pem = f.read()
    with open(key_path, "rb") as f:
        key_pem = f.read()
    leaf = x509.load_pem_x509_certificate(cert_pem)
    fds = []
    try:
        for data in (cert_pem, key_pem):
            fd = os.memfd_create("sandman-tls", os.MFD_CLOEXEC)
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        paths = (f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(*paths)  # the trial
        context.load_cert_chain(*paths)
    finally:
        for fd in fds:
            os.close(fd)
    return leaf


def split_bundle(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem) if pem and pem.strip() else []


def join_bundle(certs: list[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def needs_renewal(cert: x509.Certificate, now: datetime.datetime | None = None) -> bool:
    now = now or _now()
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - now < lifetime / RENEW_FRACTION


def signed_by(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, Exception):  # InvalidSignature is not a ValueError
        return False


def _sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    return (set(ext.get_values_for_type(x509.DNSName)),
            {str(i) for i in ext.get_values_for_type(x509.IPAddress)})


def service_dns_names(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local"]


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_pair(directory: str, cert_pem: bytes, key_pem: bytes, bundle_pem: bytes) -> None:
    os.makedirs(directory, exist_ok=True)
    write_atomic(os.path.join(directory, "ca.crt"), bundle_pem, 0o644)
    write_atomic(os.path.join(directory, "tls.key"), key_pem)
    write_atomic(os.path.join(directory, "tls.crt"), cert_pem, 0o644)


def self_signed_dir(directory: str, dns_names: list[str], ip_addresses: list[str]) -> str:
    """A CA and serving pair in `directory` (ca.crt, ca.key, tls.crt, tls.key), made or renewed
    when missing, expiring or for other names. Returns the directory."""
    paths = {n: os.path.join(directory, n) for n in ("ca.crt", "ca.key", "tls.crt", "tls.key")}
    os.makedirs(directory, exist_ok=True)
    try:
        with open(paths["ca.crt"], "rb") as f:
            ca_pem = f.read()
        with open(paths["ca.key"], "rb") as f:
            ca_key = f.read()
        ca = split_bundle(ca_pem)[0]
        if needs_renewal(ca):
            raise ValueError("CA renewal due")
    except (OSError, ValueError, IndexError):
        ca_pem, ca_key = new_ca()
        ca = split_bundle(ca_pem)[0]
        write_atomic(paths["ca.key"], ca_key)
        write_atomic(paths["ca.crt"], ca_pem, 0o644)
    try:
        with open(paths["tls.crt"], "rb") as f:
            leaf = x509.load_pem_x509_certificate(f.read())
        fresh = (signed_by(leaf, ca) and not needs_renewal(leaf)
                 and _sans(leaf) == (set(dns_names), set(ip_addresses)))
    except (OSError, ValueError):
        fresh = False
    if not fresh:
        cert, key = new_serving(ca_pem, ca_key, dns_names, ip_addresses)
        write_pair(directory, cert, key, ca_pem)
    return directory


# --- in the cluster --------------------------------------------------------------------------

@dataclass
class EnsureResult:
    ca_rotated: bool
    bundle_patched: bool
    leaf_issued: bool
    bundle_pem: bytes


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _read_secret(core, namespace: str, name: str) -> dict[str, bytes] | None:
    from kubernetes.client.rest import ApiException

    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _write_secret(core, namespace: str, name: str, data: dict[str, bytes], type_: str) -> None:
    from kubernetes.client.rest import ApiException

    body = {"apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "sandman-webhook-certs"}},
            "data": {k: _b64(v) for k, v in data.items()}}
    try:
        core.replace_namespaced_secret(name, namespace, body)
    except ApiException as e:
        if e.status != 404:
            raise
        core.create_namespaced_secret(namespace, body)


def patch_ca_bundle(admission_api, mutating: list[str], validating: list[str],
                    bundle_pem: bytes) -> bool:
    """Set caBundle on every webhook of the named configurations. True if anything changed."""
    from kubernetes.client.rest import ApiException

    want = _b64(bundle_pem)
    changed = False
    kinds = [(n, admission_api.read_mutating_webhook_configuration,
              admission_api.patch_mutating_webhook_configuration) for n in mutating]
    kinds += [(n, admission_api.read_validating_webhook_configuration,
               admission_api.patch_validating_webhook_configuration) for n in validating]
    for name, read, patch in kinds:
        for attempt in range(5):
            obj = read(name)
            hooks = obj.webhooks or []
            if all(h.client_config.ca_bundle == want for h in hooks):
                break
            ops = [{"op": "test", "path": "/metadata/resourceVersion",
                    "value": obj.metadata.resource_version}]
            ops += [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": want}
                    for i in range(len(hooks))]
            try:
                patch(name, ops)
                changed = True
                break
            except ApiException as e:
                if e.status not in (409, 422) or attempt == 4:
                    raise
    return changed


def ensure(core, admission_api, namespace: str, secret: str, dns_names: list[str],
           ip_addresses: Sequence[str] = (), mutating: Sequence[str] = (),
           validating: Sequence[str] = (),
           force_ca_rotation: bool = False, propagation_seconds: float = 10.0,
           write_dir: str | None = None) -> EnsureResult:
    """Bring CA, bundle, configurations and serving pair to a good state, in the safe order."""
    ca_name = f"{secret}-ca"
    now = _now()
    ca_data = _read_secret(core, namespace, ca_name) or {}
    bundle = [c for c in split_bundle(ca_data.get("ca.crt", b"")) if c.not_valid_after_utc > now]
    ca_key = ca_data.get("ca.key")
    rotated = False
    if not bundle or not ca_key or force_ca_rotation or needs_renewal(bundle[0], now):
        new_pem, ca_key = new_ca()
        bundle = split_bundle(new_pem) + bundle  # new first; old ones stay while valid
        rotated = True
    bundle_pem = join_bundle(bundle)
    if rotated or bundle_pem != ca_data.get("ca.crt"):
        _write_secret(core, namespace, ca_name, {"ca.crt": bundle_pem, "ca.key": ca_key}, "Opaque")
    # The API server must trust the new CA before any replica presents a certificate it signed.
    patched = patch_ca_bundle(admission_api, list(mutating), list(validating), bundle_pem)

    tls = _read_secret(core, namespace, secret) or {}
    signer = bundle[0]
    try:
        leaf = x509.load_pem_x509_certificate(tls["tls.crt"])
        fresh = (signed_by(leaf, signer) and not needs_renewal(leaf, now)
                 and _sans(leaf) == (set(dns_names), set(ip_addresses)) and "tls.key" in tls)
    except (KeyError, ValueError):
        fresh = False
    issued = False
    if not fresh:
        if patched and propagation_seconds > 0:
            log.info("caBundle patched; waiting %.0fs before serving a certificate of the new CA",
                     propagation_seconds)
            time.sleep(propagation_seconds)
        cert_pem, key_pem = new_serving(join_bundle([signer]), ca_key, dns_names, ip_addresses)
        tls = {"tls.crt": cert_pem, "tls.key": key_pem}
        issued = True
    tls["ca.crt"] = bundle_pem
    if issued or tls != (_read_secret(core, namespace, secret) or {}):
        _write_secret(core, namespace, secret, tls, "kubernetes.io/tls")
    if write_dir:
        write_pair(write_dir, tls["tls.crt"], tls["tls.key"], bundle_pem)
    return EnsureResult(rotated, patched, issued, bundle_pem)
