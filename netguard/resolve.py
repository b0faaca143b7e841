"""`svc/NAME.NAMESPACE:PORT` entries to addresses, at apply time, through the pod's resolver.

Imported only when an `--allow-egress` entry names a Service: a guard without one never loads
it (its threads, and the resolver's libraries, are CPU on every guarded start).

The name asked is `NAME.NAMESPACE.svc.<cluster domain>.` (absolute: no search-list walk, so
no other domain's answer), the cluster domain read from the `svc.<domain>` entry the kubelet
writes into every pod's resolv.conf search list. Every A and AAAA answer is allowed; a name
without an answer, one that is an alias (CNAME: an ExternalName Service), or not answered
within TIMEOUT, fails the apply closed.
"""

from __future__ import annotations

import socket
import threading
import time

from netguard.config import ConfigError

RESOLV_CONF = "/etc/resolv.conf"
# The resolver reads it before DNS; the kubelet writes a pod's hostAliases into it.
HOSTS = "/etc/hosts"
# All names together: the kubelet's default resolv.conf (timeout 5 s, 2 attempts) could take
# 10 s per name and server; the init container must fail fast instead.
TIMEOUT = 5.0
# A Service's ClusterIP is one address per family; a headless Service answers with its pods.
# More than this many is refused rather than rendered into as many rules.
MAX_ADDRESSES = 64


def cluster_domain(path: str = RESOLV_CONF) -> str:
    """The cluster domain (`cluster.local`) from resolv.conf's search list."""
    try:
        with open(path) as f:
            lines = f.read(65536).splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path} for the cluster domain: {e.strerror}") from None
    search: list[str] = []
    for line in lines:
        words = line.split()
        if words and words[0] in ("search", "domain"):
            search = words[1:]  # the last one wins, as in the resolver
    # The kubelet writes `<ns>.svc.<domain> svc.<domain> <domain>` first: the domain is the
    # third of the first such triple. Not merely the first `svc.` entry: in a namespace named
    # svc that is `svc.svc.<domain>`, and the names asked would land in the pod's own
    # namespace, whose Services its tenant may write.
    names = [d.rstrip(".") for d in search]
    for i in range(len(names) - 2):
        own, svc, domain = names[i:i + 3]
        if domain and svc == f"svc.{domain}" and own.endswith(f".svc.{domain}") and \
                own != f".svc.{domain}":
            return domain
    raise ConfigError(f"no svc.<cluster domain> in {path}'s search list: cannot resolve "
                      "svc/ entries outside a Kubernetes pod")


def _hosts_names(path: str) -> set[str]:
    try:
        with open(path) as f:
            text = f.read(1 << 20)
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    return {w.rstrip(".").lower() for line in text.splitlines()
            for w in line.split("#", 1)[0].split()[1:]}


def services(entries: tuple[str, ...], timeout: float = TIMEOUT,
             path: str = RESOLV_CONF, hosts: str = HOSTS) -> dict[str, list[str]]:
    """Canonical `svc/NAME.NS:PORT/PROTO` entry -> its addresses (sorted); ConfigError (one
    line) when any has none or the resolver does not answer in time."""
    domain = cluster_domain(path)
    names = {e: f"{e[4:].rpartition(':')[0]}.svc.{domain}." for e in entries}
    pinned = _hosts_names(hosts)
    for entry, name in names.items():
        if name.rstrip(".") in pinned:
            raise ConfigError(f"--allow-egress {entry!r}: {name} is named in {hosts} (the "
                              "pod's hostAliases?): only the cluster's DNS may answer for it")
    results: dict[str, list[str] | str] = {}

    def lookup(entry: str, name: str) -> None:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM,
                                       flags=socket.AI_CANONNAME)
        except OSError as e:
            results[entry] = str(e.strerror or e)
            return
        # An alias (an ExternalName Service is a CNAME) would let whoever may create Services
        # in an admitted namespace point the entry anywhere: only the Service's own addresses.
        canon = next((i[3] for i in infos if i[3]), name).rstrip(".").lower()
        if canon != name.rstrip(".").lower():
            results[entry] = f"an alias for {canon} (an ExternalName Service?), not a Service's own address"
            return
        results[entry] = sorted({str(i[4][0]) for i in infos})

    threads = [threading.Thread(target=lookup, args=(e, n), daemon=True)
               for e, n in names.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out: dict[str, list[str]] = {}
    for entry, name in names.items():
        got = results.get(entry)
        if got is None:
            raise ConfigError(f"--allow-egress {entry!r}: {name} did not resolve within "
                              f"{timeout:g} s")
        if isinstance(got, str) or not got:
            raise ConfigError(f"--allow-egress {entry!r}: {name} does not resolve "
                              f"({got or 'no address'})")
        if len(got) > MAX_ADDRESSES:
            raise ConfigError(f"--allow-egress {entry!r}: {name} resolved to {len(got)} "
                              f"addresses, more than {MAX_ADDRESSES}")
        out[entry] = got
    return out
