"""The load test as a Kubernetes Job next to the trainers: `python -m loadtest.job [options]
[-- locust options] > loadtest.yaml; kubectl apply -f loadtest.yaml` (docs/loadtest.md "In the
cluster"). Rendered here rather than in the chart: a load test is a one-off an operator runs
against an install, never part of the release itself.

What it renders, in this order (apply it whole; delete it whole with `kubectl delete -f`):
- ServiceAccount <name> in the trainers' namespace, and a RoleBinding there to the chart's
  user ClusterRole (`rbac.userClusterRole`, default sandman-user): the Job acquires as a trainer
  of that tenant namespace, with a projected token for the controller's audience;
- a Role + RoleBinding in the sandbox namespace: get/list/watch pods, for the POD_READY watch
  and the leak audit (which read in-cluster config: the pod's own API token);
- with --locustfile-path, a ConfigMap holding that file (mounted at /etc/loadtest);
- the Job: one pod labelled as a trainer (the controller's and the sandboxes' NetworkPolicies
  admit it; the namespace must carry the trainers label, an admin's step), running
  `python3 -m loadtest <locustfile> --headless --kubeconfig in-cluster ...`, backoffLimit 0
  (a load test never re-runs by itself), bounded by activeDeadlineSeconds. Its exit code is
  locust's, so the Job fails when a threshold fails or a task raised.

With --workers N (0, the default, is the one process above), locust runs distributed: the Job
above is the master (`--master --expect-workers N`, the same run options: the shape, the pod
watch, the leak audit, the thresholds and the exit code are the master's), a Job <name>-worker
of N pods (`--worker --master-host <name>-master`) runs the users, a ClusterIP Service
<name>-master gives the master's port (MASTER_PORT) a name, and a NetworkPolicy admits the
workers to that port and nothing else to the master. The workers exit when the master quits
(locust's quit message), so the run ends when the master's Job does.

The controller's URL, token file and CA file reach the SDK as $SANDMAN_URL,
$SANDMAN_TOKEN_FILE and (only with --ca-configmap, for an https URL) $SANDMAN_CA_FILE.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from sandman import contract
from sandman.client._core import ENV_CA_FILE, ENV_TOKEN_FILE, ENV_URL

TRAINER_LABEL = f"{contract.DOMAIN}/trainer"  # networkPolicy.trainerSelector's default
TRAINERS_NS_LABEL = f"{contract.DOMAIN}/trainers"  # networkPolicy.controllerCallers' default
TOKEN_DIR = "/var/run/secrets/sandman"
CA_DIR = "/var/run/secrets/sandman-ca"
LOCUSTFILE_DIR = "/etc/loadtest"
OUT_DIR = "/tmp/loadtest"
MASTER_PORT = 5557  # locust's default --master-bind-port
COMPONENT = "app.kubernetes.io/component"
# How long the master waits for all its workers before giving up (locust then exits 1).
EXPECT_WORKERS_MAX_WAIT_S = 300


def render(*, name: str, namespace: str, sandbox_namespace: str, image: str,
           controller_url: str, locust_args: list[str], locustfile: str = "acquire_burst",
           locustfile_text: str | None = None, ca_configmap: str = "",
           ca_key: str = "ca.crt", audience: str = "sandman",
           user_clusterrole: str = "sandman-user", cpu: str = "500m", memory: str = "512Mi",
           deadline_s: int = 1800, image_pull_policy: str = "IfNotPresent",
           node_selector: dict[str, str] | None = None,
           tolerations: list[dict] | None = None, workers: int = 0,
           worker_cpu: str = "500m", worker_memory: str = "512Mi") -> list[dict]:
    if workers < 0:
        raise ValueError(f"--workers {workers}: 0 (one process) or more")
    if not controller_url.startswith("https://"):
        # The Job's pod always carries a projected token, and the SDK never sends one over
        # plain http; the chart's controller serves https only.
        raise ValueError(f"--controller-url {controller_url!r}: the Job sends a ServiceAccount "
                         "token, so it must be https (the chart's controller, e.g. "
                         "https://sandman-controller.sandman-system.svc:8080, with "
                         "--ca-configmap sandman-ca)")
    if not ca_configmap:
        # The SDK would verify against the system bundle, which does not hold a cluster CA.
        raise ValueError("an https controller URL needs --ca-configmap (the controller's CA)")
    labels = {"app.kubernetes.io/name": "sandman-loadtest", "app.kubernetes.io/instance": name}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount",
          "metadata": {"name": name, "namespace": namespace, "labels": labels}}
    subject = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    user_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": f"{name}-{user_clusterrole}", "namespace": namespace,
                     "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": user_clusterrole},
        "subjects": subject}
    audit_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": f"{name}-leak-audit", "namespace": sandbox_namespace,
                     "labels": labels},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
    audit_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": f"{name}-leak-audit", "namespace": sandbox_namespace,
                     "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": f"{name}-leak-audit"},
        "subjects": subject}
    objs = [sa, user_binding, audit_role, audit_binding]

    env = [{"name": ENV_URL, "value": controller_url},
           {"name": ENV_TOKEN_FILE, "value": f"{TOKEN_DIR}/token"},
           # The root filesystem is read-only: anything locust writes goes to the emptyDir.
           {"name": "HOME", "value": OUT_DIR}]
    volumes = [
        {"name": "sandman-token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": audience, "expirationSeconds": 3600, "path": "token"}}]}},
        {"name": "out", "emptyDir": {}}]
    mounts = [{"name": "sandman-token", "mountPath": TOKEN_DIR, "readOnly": True},
              {"name": "out", "mountPath": OUT_DIR}]
    if ca_configmap:
        env.append({"name": ENV_CA_FILE, "value": f"{CA_DIR}/{ca_key}"})
        volumes.append({"name": "sandman-ca", "configMap": {"name": ca_configmap}})
        mounts.append({"name": "sandman-ca", "mountPath": CA_DIR, "readOnly": True})
    target = locustfile
    if locustfile_text is not None:
        filename = Path(locustfile).name
        objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": f"{name}-locustfile", "namespace": namespace,
                                  "labels": labels},
                     "data": {filename: locustfile_text}})
        volumes.append({"name": "locustfile", "configMap": {"name": f"{name}-locustfile"}})
        mounts.append({"name": "locustfile", "mountPath": LOCUSTFILE_DIR, "readOnly": True})
        target = f"{LOCUSTFILE_DIR}/{filename}"
    args = [target, "--only-summary", "--kubeconfig", "in-cluster",
            "--namespace", sandbox_namespace, "--job", name, "--csv", f"{OUT_DIR}/run",
            *locust_args]
    master = f"{name}-master"
    if workers:
        args += ["--master", "--master-bind-port", str(MASTER_PORT),
                 "--expect-workers", str(workers),
                 "--expect-workers-max-wait", str(min(EXPECT_WORKERS_MAX_WAIT_S, deadline_s))]

    def job(job_name: str, component: str | None, job_args: list[str], job_cpu: str,
            job_memory: str, count: int = 1) -> dict:
        pod_labels = {**labels, TRAINER_LABEL: "true", **({COMPONENT: component} if component
                                                          else {})}
        spec: dict = {
            "serviceAccountName": name,
            # The API token (in-cluster config of the watch and the audit) is the pod's own.
            "automountServiceAccountToken": True,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "locust", "image": image, "imagePullPolicy": image_pull_policy,
                "command": ["python3", "-m", "loadtest"], "args": job_args, "env": env,
                "workingDir": OUT_DIR,
                "volumeMounts": mounts,
                "resources": {"requests": {"cpu": job_cpu, "memory": job_memory},
                              "limits": {"cpu": job_cpu, "memory": job_memory}},
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}}],
            "volumes": volumes}
        if component == "locust-master":
            spec["containers"][0]["ports"] = [{"name": "locust-master",
                                               "containerPort": MASTER_PORT}]
        if node_selector:
            spec["nodeSelector"] = node_selector
        if tolerations:
            spec["tolerations"] = tolerations
        counts = {"completions": count, "parallelism": count} if count > 1 else {}
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job_name, "namespace": namespace, "labels": labels},
            "spec": {"backoffLimit": 0, "activeDeadlineSeconds": deadline_s, **counts,
                     "template": {"metadata": {"labels": pod_labels}, "spec": spec}}}

    if not workers:
        objs.append(job(name, None, args, cpu, memory))
        return objs
    master_sel = {"app.kubernetes.io/instance": name, COMPONENT: "locust-master"}
    worker_sel = {"app.kubernetes.io/instance": name, COMPONENT: "locust-worker"}
    objs.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": master, "namespace": namespace, "labels": labels},
        # A ClusterIP, not headless: its name resolves before the master's pod is up, and
        # the workers' connection retries until it is.
        "spec": {"selector": master_sel,
                 "ports": [{"name": "locust-master", "port": MASTER_PORT,
                            "targetPort": MASTER_PORT, "protocol": "TCP"}]}})
    # The master listens on MASTER_PORT for its workers and serves nothing else (headless: no
    # web UI): only its own workers may connect, and only to that port.
    objs.append({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": master, "namespace": namespace, "labels": labels},
        "spec": {"podSelector": {"matchLabels": master_sel}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": worker_sel}}],
                              "ports": [{"protocol": "TCP", "port": MASTER_PORT}]}]}})
    objs.append(job(name, "locust-master", args, cpu, memory))
    # A worker takes the run's options from the master with each spawn message; its own
    # command line only says where the master is.
    worker_args = [target, "--worker", "--master-host", master, "--master-port",
                   str(MASTER_PORT)]
    objs.append(job(f"{name}-worker", "locust-worker", worker_args, worker_cpu, worker_memory,
                    count=workers))
    return objs


def _kv(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"expected key=value: {text!r}")
    return k, v


def _toleration(text: str) -> dict:
    """key=value:Effect"""
    kv, _, effect = text.partition(":")
    k, v = _kv(kv)
    if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise argparse.ArgumentTypeError(f"toleration {text!r}: key=value:Effect")
    return {"key": k, "operator": "Equal", "value": v, "effect": effect}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m loadtest.job", description=__doc__.split(
        "\n\n")[0], epilog="Everything after `--` goes to locust (e.g. --shape two-runs "
        "--max-p99-ms 30000 --max-leaked 0).")
    p.add_argument("--name", default="sandman-loadtest", help="Job, ServiceAccount and run job")
    p.add_argument("--namespace", required=True,
                   help=f"the trainers' namespace (labelled {TRAINERS_NS_LABEL}=true)")
    p.add_argument("--sandbox-namespace", default="sandboxes")
    p.add_argument("--image", required=True, help="the `loadtest` target of images/Dockerfile")
    p.add_argument("--image-pull-policy", default="IfNotPresent")
    p.add_argument("--controller-url", required=True,
                   help="https only, e.g. https://sandman-controller.sandman-system.svc:8080")
    p.add_argument("--ca-configmap", default="",
                   help="ConfigMap with the controller's CA (https URLs), NAME or NAME:KEY")
    p.add_argument("--audience", default="sandman", help="controller.auth.audience")
    p.add_argument("--user-clusterrole", default="sandman-user", help="rbac.userClusterRole")
    p.add_argument("--locustfile", default="acquire_burst",
                   help="acquire_burst, execd_storm")
    p.add_argument("--locustfile-path", type=Path,
                   help="a local locustfile, shipped in a ConfigMap instead")
    p.add_argument("--cpu", default="500m")
    p.add_argument("--memory", default="512Mi")
    p.add_argument("--deadline-s", type=int, default=1800)
    p.add_argument("--workers", type=int, default=0,
                   help="locust workers (0: one process); N > 0: a master and N worker pods")
    p.add_argument("--worker-cpu", default="500m", help="each worker's (--cpu: the master's)")
    p.add_argument("--worker-memory", default="512Mi")
    p.add_argument("--node-selector", type=_kv, action="append", default=[])
    p.add_argument("--toleration", type=_toleration, action="append", default=[])
    o = p.parse_args(argv)
    cm, _, key = o.ca_configmap.partition(":")
    try:
        objs = render(
            name=o.name, namespace=o.namespace, sandbox_namespace=o.sandbox_namespace,
            image=o.image, controller_url=o.controller_url, locust_args=extra,
            locustfile=o.locustfile_path.name if o.locustfile_path else o.locustfile,
            locustfile_text=o.locustfile_path.read_text() if o.locustfile_path else None,
            ca_configmap=cm, ca_key=key or "ca.crt", audience=o.audience,
            user_clusterrole=o.user_clusterrole, cpu=o.cpu, memory=o.memory,
            deadline_s=o.deadline_s, image_pull_policy=o.image_pull_policy,
            node_selector=dict(o.node_selector), tolerations=o.toleration,
            workers=o.workers, worker_cpu=o.worker_cpu, worker_memory=o.worker_memory)
    except (ValueError, OSError) as e:
        print(f"loadtest.job: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
