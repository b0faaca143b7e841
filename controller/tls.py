"""TLS of the controller API: the serving pair, reloaded when its files change; the CA that a
standby verifies the leader with; the CA bundle published for trainers (docs/controller.md,
"TLS").

Callers send ServiceAccount tokens and receive sandbox tokens: in clear text on the pod
network, anyone on the path could take them. So with `--auth kubernetes` the controller serves
https, and refuses to start without a certificate unless told `--insecure-http` (fail closed).

Rotation without a restart: the SSLContext object handed to uvicorn stays the same;
`load_cert_chain` on it swaps the pair for new handshakes, established connections keep theirs
(the same scheme as webhook/server.py). `watch()` stats the files every `interval` seconds on
the event loop (the thread that runs handshakes); a half-written pair (new cert, old key) fails
to load and the old pair keeps serving until the next check. Kubelet updates a mounted Secret
by swapping a `..data` symlink, so cert and key change together and stat() sees new inodes.

The CA file (`--tls-ca-file`, the Secret's ca.crt: the CA bundle, newest first) serves twice:
a standby verifies the leader against it, by the Service's DNS name (the leader is reached by
pod IP, which no certificate names: SNI and hostname check use `--tls-server-name`), and the
controller copies it into the ConfigMap `--ca-configmap`, which trainers mount as
$SANDMAN_CA_FILE. A CA added on rotation is added to the verifying context (OpenSSL only ever
adds; a retired CA is expired, so it verifies nothing).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
from collections.abc import Callable

from webhook.certs import load_pair

log = logging.getLogger("controller.tls")

# A stat() of three files per check. Kubelet refreshes mounted Secrets within about a minute
# (its sync period plus cache TTL), and certificates renew weeks before expiry: 10 s is ample.
RELOAD_INTERVAL_S = 10.0
CA_KEY = "ca.crt"  # the key of the published ConfigMap, like the Secrets' own ca.crt


def _stamp(path: str) -> tuple:
    st = os.stat(path)  # follows the ..data symlink of Secret volumes
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class ServingTLS:
    """The controller's serving SSLContext, reloaded in place when the files change."""

    def __init__(self, cert: str, key: str):
        self.cert, self.key = cert, key
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        self.not_after: datetime.datetime | None = None
        self.loads = 0
        self._stamps: tuple | None = None
        self.reload(first=True)

    def reload(self, first: bool = False) -> bool:
        """Load the pair if it changed. True when the context holds a valid pair. The first
        load raises ValueError (one line) instead: nothing to keep serving."""
        try:
            stamps = (_stamp(self.cert), _stamp(self.key))
        except OSError as e:
            if first:
                raise ValueError(f"cannot load the TLS certificate {self.cert} / key "
                                 f"{self.key}: {e.strerror or e}") from None
            log.warning("TLS files unreadable, keeping the loaded pair: %s", e)
            return self._stamps is not None
        if stamps == self._stamps:
            return True
        try:
            # A trial load first: OpenSSL installs the certificate before it checks the key,
            # so a failed load into the live context would leave a certificate without its
            # key there (every handshake failing) instead of the previous pair.
            leaf = load_pair(self.context, self.cert, self.key)
        except (OSError, ssl.SSLError, ValueError) as e:
            if first:
                raise ValueError(f"cannot load the TLS certificate {self.cert} / key "
                                 f"{self.key}: {' '.join(str(e).split())}") from None
            log.warning("TLS certificate reload failed, keeping the loaded pair: %s", e)
            return self._stamps is not None
        self._stamps = stamps
        self.loads += 1
        self.not_after = leaf.not_valid_after_utc
        log.info("serving certificate loaded, valid until %s", self.not_after.isoformat())
        return True


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class PeerCA:
    """The client SSLContext a standby verifies the leader with (never CERT_NONE)."""

    def __init__(self, ca_file: str | None):
        self.ca_file = ca_file
        self.context = ssl.create_default_context(cafile=ca_file)
        self.pem = _read(ca_file) if ca_file else b""
        self._stamp = _stamp(ca_file) if ca_file else None


    def reload(self) -> bool:
        """Trust a CA added to the file. True when the file changed (and was loaded)."""
        if not self.ca_file:
            return False
        try:
            stamp = _stamp(self.ca_file)
            if stamp == self._stamp:
                return False
            pem = _read(self.ca_file)
            self.context.load_verify_locations(cadata=pem.decode("ascii"))
        except (OSError, ssl.SSLError, ValueError, UnicodeDecodeError) as e:
            log.warning("CA file reload failed, keeping the loaded CAs: %s", e)
            return False
        self._stamp, self.pem = stamp, pem
        log.info("CA bundle %s reloaded", self.ca_file)
        return True


class CAPublisher:
    """Keeps ConfigMap `name` in `namespace` holding the CA bundle (key ca.crt), for trainers.

    The chart creates the ConfigMap without data (so Helm upgrades leave the key alone) and
    grants get/patch on that one name. Every replica publishes the same file: idempotent."""

    def __init__(self, core, namespace: str, name: str, timeout: float = 5.0):
        self.core, self.namespace, self.name, self.timeout = core, namespace, name, timeout

    def publish(self, pem: bytes) -> bool:
        """Patch the ConfigMap if it differs. True if patched. Runs in a thread."""
        text = pem.decode("ascii")
        cm = self.core.read_namespaced_config_map(self.name, self.namespace,
                                                  _request_timeout=self.timeout)
        if (cm.data or {}).get(CA_KEY) == text:
            return False
        self.core.patch_namespaced_config_map(self.name, self.namespace,
                                              {"data": {CA_KEY: text}},
                                              _request_timeout=self.timeout)
        log.info("CA bundle published in configmap %s/%s", self.namespace, self.name)
        return True


async def watch(serving: ServingTLS | None, peer: PeerCA | None,
                publish: Callable[[bytes], bool] | None,
                interval: float = RELOAD_INTERVAL_S, republish_every: int = 30) -> None:
    """Reload changed files every `interval` s; (re)publish the CA bundle at start, when it
    changes, and every `republish_every` checks (someone may have emptied the ConfigMap)."""
    loop = asyncio.get_running_loop()
    checks = 0
    pending = publish is not None and peer is not None and bool(peer.pem)
    while True:
        if pending and publish is not None and peer is not None:  # (pending says they are)
            try:
                await loop.run_in_executor(None, publish, peer.pem)
                pending = False
            except Exception as e:  # noqa: BLE001 - API errors: retried on the next check
                log.warning("publishing the CA bundle failed (retried): %s", e)
        await asyncio.sleep(interval)
        checks += 1
        if serving is not None:
            serving.reload()
        if peer is not None and (peer.reload() or checks % republish_every == 0):
            pending = publish is not None and bool(peer.pem)
