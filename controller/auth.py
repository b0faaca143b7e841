"""Who may call the controller (docs/controller.md, "Authentication and tenants").

Callers present a Kubernetes ServiceAccount token (projected, audience `sandman` by default) as
`Authorization: Bearer`. The controller asks the API server: a TokenReview (with the audience)
says who the caller is, a SubjectAccessReview says what it may do, as kube-rbac-proxy and
aggregated API servers do. The resource is virtual: group `sandman.dev`, resource `sandboxes`,
in the caller's TENANT namespace (a sandbox's pod lives in the sandbox namespace; its tenant is
a namespace the caller is granted rights in, by default its own ServiceAccount's).

Answers are cached briefly (bounded size, `ttl` seconds) so an acquire pays no API round trip
in the steady state; concurrent identical questions share one call. Errors are never cached
and fail closed: no answer from the API server is 503 `AuthUnavailable`, never a pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from controller.errors import AuthUnavailable, BadRequest, Forbidden, Unauthenticated
from sandman import contract

log = logging.getLogger("controller.auth")

MODES = ("none", "kubernetes")
GROUP = contract.DOMAIN  # the virtual API group the RBAC rules name
RESOURCE = "sandboxes"
# Verbs, as RBAC spells them: what each route needs.
CREATE, GET, LIST, DELETE, DELETECOLLECTION = "create", "get", "list", "delete", "deletecollection"
UPDATE = "update"  # renew: moves a sandbox's expiry
# Admin operations: subresources checked at cluster scope (namespace ""), which only a
# ClusterRoleBinding grants: prewarm makes pods no tenant owns, stats shows every tenant.
PREWARM_SUB, STATS_SUB = "prewarm", "stats"
# The image pre-pull: create (POST /v1/images) pulls onto every node, get reads the progress.
IMAGES_SUB = "images"
CLUSTER = ""
DEFAULT_AUDIENCE = "sandman"
SA_PREFIX = "system:serviceaccount:"
# A label key: optional DNS-subdomain prefix, then a name.
# Prefixes no caller may set, whatever --caller-label-prefix says: Kubernetes' own
# (app.kubernetes.io/* names the controller and the chart's pods: a sandbox carrying the
# controller's labels would be the sandbox NetworkPolicy's "controller" peer) and sandman's.
RESERVED_SUFFIXES = ("kubernetes.io", "k8s.io", contract.DOMAIN)


@dataclass(frozen=True)
class Caller:
    """Who called, as the TokenReview said."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def namespace(self) -> str | None:
        """A ServiceAccount's namespace (the default tenant); None for other users."""
        if not self.username.startswith(SA_PREFIX):
            return None
        ns = self.username[len(SA_PREFIX):].split(":", 1)[0]
        return ns or None

    @property
    def key(self) -> str:
        """A short stable identity: request-id dedup is keyed by it, so a replay of someone
        else's request_id is a new request of the replayer's, never the other's sandbox."""
        return hashlib.sha256(f"{self.username}\0{self.uid}".encode()).hexdigest()[:16]


LOCAL = Caller("system:sandman:auth-none")  # every caller under --auth none


# ---- tenants and jobs

def check_tenant(ns: str) -> str:
    if not contract.is_dns_label(ns or ""):
        raise BadRequest(f"namespace {ns!r} is not a namespace name (1-63 of [a-z0-9-])")
    return ns


def scoped_job(tenant: str | None, job: str) -> str:
    """The controller's job key: `<tenant>.<job>`, so two tenants' jobs of one name are two
    jobs (pacing, caps, drain, owner ConfigMap, request dedup). A namespace has no dot, so the
    first dot ends the tenant. Unscoped (no tenant) under --auth none."""
    if tenant is None:
        return job
    key = f"{tenant}.{job}"
    if len(key) > 63:  # it is the pod's job label value
        raise BadRequest(f"job {job!r}: with its tenant {tenant!r} the job key {key!r} is "
                         "longer than 63 characters; use a shorter job name")
    return key


def tenant_of(key: str) -> str:
    """The pacer's tenant of a job key: its namespace, '' for an unscoped key (the warm pool's
    refills, which count as sandman's own)."""
    return split_job(key)[0] or ""


def split_job(key: str) -> tuple[str | None, str]:
    """(tenant, job) of a job key; tenant None for unscoped keys (the warm pool's, --auth
    none's). Keys made under --auth none with a dot read as scoped: switching a controller
    with live sandboxes from none to kubernetes is not supported (docs/controller.md)."""
    tenant, dot, job = key.partition(".")
    if dot and contract.is_dns_label(tenant):
        return tenant, job
    return None, key


@dataclass(frozen=True)
class LabelPolicy:
    """Label keys a caller may put on its sandbox: unprefixed keys, plus keys under the
    `--caller-label-prefix` prefixes; never a reserved prefix."""

    prefixes: tuple[str, ...] = ()

    def check(self, labels: dict[str, str]) -> None:
        for k in labels:
            prefix, slash, name = k.rpartition("/")
            if not contract.is_label_name(name) or (slash and not contract.is_dns_subdomain(prefix)):
                raise BadRequest(f"label {k!r}: not a valid label key")
            if not slash:
                continue
            if reserved_prefix(prefix):
                raise BadRequest(f"label {k!r}: the prefix {prefix}/ is reserved "
                                 "(Kubernetes' and sandman's own labels)")
            if prefix not in self.prefixes:
                raise BadRequest(f"label {k!r}: the prefix {prefix}/ is not allowed; allowed: "
                                 "unprefixed keys" + "".join(f", {p}/*" for p in self.prefixes))


def reserved_prefix(prefix: str) -> bool:
    prefix = prefix.rstrip("/")
    return any(prefix == r or prefix.endswith("." + r) for r in RESERVED_SUFFIXES)


# ---- the cache

class TTLCache:
    """At most `size` answers, each for `ttl` seconds; least recently used dropped first."""

    def __init__(self, ttl: float, size: int) -> None:
        self.ttl, self.size = ttl, size
        self._d: OrderedDict[Any, tuple[float, Any]] = OrderedDict()

    def get(self, key: Any) -> tuple[bool, Any]:
        hit = self._d.get(key)
        if hit is None:
            return False, None
        if hit[0] <= time.monotonic():
            del self._d[key]
            return False, None
        self._d.move_to_end(key)
        return True, hit[1]

    def put(self, key: Any, value: Any) -> None:
        if self.ttl <= 0 or self.size <= 0:
            return
        self._d[key] = (time.monotonic() + self.ttl, value)
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


# ---- the authenticators

class NoAuth:
    """--auth none: every caller is LOCAL and may do everything. For local use only."""

    enabled = False

    async def authenticate(self, authorization: str | None) -> Caller:
        return LOCAL

    async def allowed(self, caller: Caller, verb: str, namespace: str,
                      subresource: str = "") -> bool:
        return True

    async def require(self, caller: Caller, verb: str, namespace: str,
                      subresource: str = "") -> None:
        return None

    def close(self) -> None:
        pass


@dataclass
class KubeAuth:
    """--auth kubernetes: TokenReview + SubjectAccessReview, cached."""

    api_client: Any  # kubernetes.client.ApiClient
    audience: str = DEFAULT_AUDIENCE
    ttl: float = 10.0
    size: int = 4096
    timeout: float = 5.0
    threads: int = 8
    enabled: bool = True
    calls: dict[str, int] = field(default_factory=lambda: {"tokenreview": 0, "sar": 0})

    def __post_init__(self) -> None:
        from kubernetes import client

        self._authn = client.AuthenticationV1Api(self.api_client)
        self._authz = client.AuthorizationV1Api(self.api_client)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="auth")
        self._tokens = TTLCache(self.ttl, self.size)
        self._access = TTLCache(self.ttl, self.size)
        self._inflight: dict[Any, asyncio.Future] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _once(self, cache: TTLCache, key: Any, fn) -> Any:
        """A cached answer, or one call shared by every concurrent asker; errors uncached."""
        hit, value = cache.get(key)
        if hit:
            return value
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
            self._inflight[key] = fut
            fut.add_done_callback(lambda f: self._done(cache, key, f))
        return await asyncio.shield(fut)

    def _done(self, cache: TTLCache, key: Any, fut: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if not fut.cancelled() and fut.exception() is None:
            cache.put(key, fut.result())

    async def authenticate(self, authorization: str | None) -> Caller:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("no bearer token: send `Authorization: Bearer <token>`, a "
                                  f"ServiceAccount token with audience {self.audience!r}")
        key = ("token", hashlib.sha256(token.encode()).hexdigest())
        caller = await self._once(self._tokens, key, lambda: self._review(token))
        if caller is None:
            raise Unauthenticated("the token was not accepted (invalid, expired, or not for "
                                  f"audience {self.audience!r})")
        return caller

    def _review(self, token: str) -> Caller | None:
        from kubernetes.client import ApiException

        self.calls["tokenreview"] += 1
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            r = self._authn.create_token_review(
                body, _request_timeout=self.timeout)  # type: ignore[arg-type]  # a dict is sent as is
        except ApiException as e:
            raise AuthUnavailable(f"TokenReview failed: {e.status} {e.reason}; the controller "
                                  "needs `create tokenreviews` (the chart's ClusterRole)") from None
        except Exception as e:  # noqa: BLE001 - no answer: fail closed
            raise AuthUnavailable(f"TokenReview: no answer from the API server: "
                                  f"{type(e).__name__}") from None
        st = r.status
        if st is None or not st.authenticated or st.user is None:
            return None
        # The API server checked the audience; an authenticator that ignores audiences
        # answers without them, and that is refused too.
        if self.audience not in (st.audiences or []):
            return None
        u = st.user
        extra = tuple(sorted((k, tuple(v or ())) for k, v in (u.extra or {}).items()))
        return Caller(u.username or "", u.uid or "", tuple(u.groups or ()), extra)

    async def allowed(self, caller: Caller, verb: str, namespace: str,
                      subresource: str = "") -> bool:
        key = ("sar", caller, verb, namespace, subresource)
        return await self._once(self._access, key,
                                lambda: self._sar(caller, verb, namespace, subresource))

    async def require(self, caller: Caller, verb: str, namespace: str,
                      subresource: str = "") -> None:
        if not await self.allowed(caller, verb, namespace, subresource):
            what = f"{RESOURCE}/{subresource}" if subresource else RESOURCE
            where = f"in namespace {namespace}" if namespace else "cluster-wide"
            raise Forbidden(f"{caller.username} may not {verb} {what}.{GROUP} {where}")

    def _sar(self, caller: Caller, verb: str, namespace: str, subresource: str) -> bool:
        from kubernetes.client import ApiException

        self.calls["sar"] += 1
        attrs = {"group": GROUP, "resource": RESOURCE, "verb": verb, "namespace": namespace}
        if subresource:
            attrs["subresource"] = subresource
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": caller.username, "uid": caller.uid,
                         "groups": list(caller.groups),
                         "extra": {k: list(v) for k, v in caller.extra},
                         "resourceAttributes": attrs}}
        try:
            r = self._authz.create_subject_access_review(
                body, _request_timeout=self.timeout)  # type: ignore[arg-type]  # a dict is sent as is
        except ApiException as e:
            raise AuthUnavailable(f"SubjectAccessReview failed: {e.status} {e.reason}; the "
                                  "controller needs `create subjectaccessreviews` (the "
                                  "chart's ClusterRole)") from None
        except Exception as e:  # noqa: BLE001 - no answer: fail closed
            raise AuthUnavailable(f"SubjectAccessReview: no answer from the API server: "
                                  f"{type(e).__name__}") from None
        return bool(r.status and r.status.allowed and not r.status.denied)
