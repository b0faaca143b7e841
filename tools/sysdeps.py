"""Install the Debian packages the tests need, only when a command is missing.

Tests that need them (netguard in network namespaces, execd with real bash) fail loudly
without them; the image tests (tests/images) skip without root or without their tools. This
step is what makes `make test` work on a fresh machine.
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
    # The real-node images (testbed/images.py, tests/images): built without Docker, run in a
    # throwaway containerd. runc, not crun: crun fails on this cgroup v1 host (hybrid mode).
    "debootstrap": "debootstrap",
    "buildah": "buildah",
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
}


def main() -> int:
    missing = sorted({pkg for cmd, pkg in NEEDED.items() if not shutil.which(cmd)})
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
    sys.exit(main())
