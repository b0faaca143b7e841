"""Admission storms: the webhook chain under a create burst, without scheduling anything.

Two user classes (pick one by name at the end of the command line, or run both):
  DryRunCreateUser     POD_CREATE: labelled sandbox pods created with `dryRun=All` through the
                       API server (authn, admission chain with our webhook, validation; nothing
                       stored, nothing scheduled: Kyverno's load tests do the same). A pod that
                       comes back without sandman's init containers counts as a failure: the
                       webhook was not called.
  AdmissionReviewUser  ADMISSION_REVIEW: raw AdmissionReview v1 requests straight at the
                       webhook's /mutate and /validate (TLS, verified with its CA).

    locust -f testbed/locustfiles/admission_storm.py --headless -u 20 -r 20 -t 30s \
        --kubeconfig KC --namespace sandboxes DryRunCreateUser
    locust -f testbed/locustfiles/admission_storm.py --headless -u 20 -r 20 -t 30s \
        --webhook-url https://127.0.0.1:8443 --webhook-ca ca.crt AdmissionReviewUser

It lives with the test bed (it builds its pods with testbed.webhook's probe_pod), not in the
loadtest package the image ships; an in-cluster Job runs it as a `--locustfile-path` ConfigMap.
Its own directory: locust puts a locustfile's directory first on sys.path, and testbed/'s
webhook.py would hide the webhook package.

The paper's reason: an unpaced evaluation of 4,096 trajectories took a shared policy webhook
down (HTTP 500 to every create, 84.9% of the evaluation's trajectories failed).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid

import requests
from locust import User, between, events, task

from loadtest import common
from loadtest.run import ADMISSION_REVIEW, POD_CREATE, RequestFailed, fire
from sandman import contract
from testbed.webhook import probe_pod

common.install([POD_CREATE, ADMISSION_REVIEW], uses_controller=False)


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("admission_storm")
    g.add_argument("--webhook-url", default="", help="https://host:port of the webhook")
    g.add_argument("--webhook-ca", default="", help="PEM CA that signed the webhook's cert")


class DryRunCreateUser(User):
    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        from kubernetes import client, config

        o = self.environment.parsed_options
        if not o.kubeconfig:
            raise RuntimeError("DryRunCreateUser needs --kubeconfig")
        cfg = client.Configuration()
        config.load_kube_config(config_file=o.kubeconfig, client_configuration=cfg)
        self.core = client.CoreV1Api(client.ApiClient(cfg))
        self.ns = o.namespace

    @task
    def create(self) -> None:
        from kubernetes.client.rest import ApiException

        pod = probe_pod(self.ns)
        pod["metadata"]["annotations"][contract.ANNOTATION_TOKEN_SHA256] = secrets.token_hex(32)
        start = time.perf_counter()
        exc = None
        size = 0
        try:
            r = self.core.create_namespaced_pod(self.ns, pod, dry_run="All",
                                                _preload_content=False, _request_timeout=30)
            size = len(r.data)
            spec = json.loads(r.data).get("spec", {})
            if not spec.get("initContainers"):
                exc = RequestFailed("admitted but not mutated: the webhook was not called")
        except ApiException as e:
            exc = RequestFailed(f"HTTP {e.status} {e.reason}")
        except Exception as e:  # noqa: BLE001 - connection errors are failures too
            exc = RequestFailed(type(e).__name__)
        fire(self.environment, POD_CREATE, "pods (dryRun=All)", start, exc, size)


class AdmissionReviewUser(User):
    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        o = self.environment.parsed_options
        if not o.webhook_url:
            raise RuntimeError("AdmissionReviewUser needs --webhook-url")
        self.base = o.webhook_url.rstrip("/")
        self.http = requests.Session()
        # Per request: a session-level `verify` loses to REQUESTS_CA_BUNDLE in the environment.
        self.verify = o.webhook_ca or True

    def _review(self, path: str, pod: dict) -> None:
        uid = str(uuid.uuid4())
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                            "resource": {"group": "", "version": "v1", "resource": "pods"},
                            "namespace": "loadtest", "operation": "CREATE", "object": pod,
                            "userInfo": {"username": "loadtest"}, "dryRun": True}}
        start = time.perf_counter()
        exc = None
        size = 0
        try:
            r = self.http.post(self.base + path, json=body, timeout=10, verify=self.verify)
            size = len(r.content)
            if r.status_code != 200:
                exc = RequestFailed(f"HTTP {r.status_code}")
            else:
                resp = r.json().get("response") or {}
                if resp.get("uid") != uid:
                    exc = RequestFailed("answer for another uid")
                elif path == "/mutate" and not (resp.get("allowed") and resp.get("patch")):
                    exc = RequestFailed("mutate: not allowed or no patch")
        except requests.RequestException as e:
            exc = RequestFailed(type(e).__name__)
        fire(self.environment, ADMISSION_REVIEW, path, start, exc, size)

    @task(3)
    def mutate(self) -> None:
        pod = probe_pod("loadtest")
        pod["metadata"]["name"] = f"lt-{secrets.token_hex(4)}"
        self._review("/mutate", pod)

    @task(1)
    def validate_unmutated(self) -> None:
        # A labelled pod the mutation never saw: the answer must be a refusal, quickly.
        pod = probe_pod("loadtest")
        pod["metadata"]["name"] = f"lt-{secrets.token_hex(4)}"
        self._review("/validate", pod)
