"""Install the Debian packages the tests need, only when a command is missing.

Tests that need them (netguard in network namespaces, execd with real bash) fail loudly
without them; the image tests (tests/images) skip without root or without their tools. This
step is what makes `make test` work on a fresh machine.

`--real-node` (make ... REAL_NODE=1) adds what the test bed's real node runs on: containerd and
runc (Debian's 1.6.20 / 1.1.5 were measured to work here), the CNI plugins, ipset for
kube-router's NetworkPolicy sets, conntrack for kube-proxy.
"""

import os
import shutil
import subprocess
import sys

# command -> Debian package providing it
NEEDED = {
    "bash": "bash",
    "ip": "iproute2",
    "iptables-restore": "iptables",
    "ip6tables-restore": "iptables",
    "iptables-legacy-restore": "iptables",
    "curl": "curl",
    # `promtool test rules` on the chart's alerts (tests/monitoring/test_alert_rules.py). The
    # package is the whole Prometheus server (19 MB); it is not started (no systemd here).
    "promtool": "prometheus",
    # The real-node images (testbed/images.py, tests/images): built without Docker, run in a
    # throwaway containerd. runc, not crun: crun fails on this cgroup v1 host (hybrid mode).
    "debootstrap": "debootstrap",
    "buildah": "buildah",
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
}
# path (a command, or a file for packages without one on PATH) -> Debian package
REAL_NODE = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/lib/cni/host-local": "containernetworking-plugins",
    "/usr/lib/cni/loopback": "containernetworking-plugins",
    "ipset": "ipset",
    "conntrack": "conntrack",
}


def _present(path: str) -> bool:
    return os.path.exists(path) if path.startswith("/") else shutil.which(path) is not None


def missing_packages(real_node: bool = False) -> list[str]:
    needed = dict(NEEDED, **(REAL_NODE if real_node else {}))
    return sorted({pkg for path, pkg in needed.items() if not _present(path)})


def main(argv: list[str]) -> int:
    env = os.environ.get("REAL_NODE", "")
    # auto (make test): wherever the real node can run at all, that is as root.
    real_node = "--real-node" in argv or env == "1" or (env == "auto" and os.geteuid() == 0)
    missing = missing_packages(real_node)
    if not missing:
        return 0
    if os.geteuid() != 0:
        print(f"sysdeps: missing Debian packages {missing} and not root; install them",
              file=sys.stderr)
        return 1
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        if subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL) != 0:
            print(f"sysdeps: `{' '.join(cmd[:3])}` failed while installing {missing}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
