"""An optional local image registry for the real node: go-containerregistry's `crane registry
serve`, bound to 127.0.0.1 only, its blobs under the real node's state dir.

The real node never pulls otherwise (testbed/realnode.py: images are imported, and containerd's
registry traffic goes to a dead proxy). A test that needs a real pull (the image pre-pull,
tests/e2e/test_prepull_on_node.py) starts one:

    reg = LocalRegistry(tb).start()
    ref = reg.push(archive, "swe/task:a")        # 127.0.0.1:PORT/swe/task@sha256:...
    ...
    reg.stop()                                   # also stopped with the bed

containerd reaches it over plain http through a certs.d `hosts.toml` written for its
`127.0.0.1:PORT` alone (the node's `config_path`), and its NO_PROXY names 127.0.0.1: every other
registry still goes to the dead proxy. The process is a component of the bed (stopped with it),
and the pushed data lives in the bed's state dir (removed with it)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

from testbed import build
from testbed.cluster import Testbed, TestbedError
from testbed.procs import Proc, reported_port

HOST = "127.0.0.1"


class RegistryError(TestbedError):
    __test__ = False


class LocalRegistry:
    def __init__(self, tb: Testbed) -> None:
        # On a kwok bed it serves the controller alone (image pinning asks it for digests;
        # kwok pulls nothing): no containerd entry.
        self.tb = tb
        self.rn = tb.realnode
        self.dir = (self.rn.dir if self.rn is not None else tb.state_dir) / "registry"
        self.port = 0
        self.proc: Proc | None = None
        self.crane: Path | None = None

    @property
    def host(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def hosts_dir(self) -> Path | None:
        """containerd's certs.d entry for this registry (the node's `config_path`)."""
        if self.rn is None:
            return None
        return self.rn.dir / "containerd" / "certs.d" / self.host

    def start(self, timeout: float = 30.0) -> LocalRegistry:
        self.crane = build.build_crane()
        (self.dir / "blobs").mkdir(parents=True, exist_ok=True)
        log = self.tb.logs / "registry.log"
        seen = log.stat().st_size if log.exists() else 0
        # Port 0: crane binds it and logs "serving on port N" (no port probed and closed).
        self.proc = self.tb._spawn("registry", [
            str(self.crane), "registry", "serve", "--address", f"{HOST}:0",
            "--disk", str(self.dir / "blobs")])
        deadline = time.monotonic() + timeout
        try:
            self.port = reported_port(self.proc, r"serving on port (\d+)", deadline, seen)
        except RuntimeError as e:
            self.stop()
            raise RegistryError(f"local registry: {e}") from None
        while not self._answers():
            if not self.proc.alive() or time.monotonic() > deadline:
                tail = self.proc.tail(500)
                self.stop()
                raise RegistryError(f"local registry not serving on {self.host} within "
                                    f"{timeout:g}s: {tail}")
            time.sleep(0.1)
        if self.hosts_dir is None:
            return self
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        (self.hosts_dir / "hosts.toml").write_text(
            f'server = "http://{self.host}"\n\n'
            f'[host."http://{self.host}"]\n  capabilities = ["pull", "resolve"]\n')
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://{self.host}/v2/", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def _crane(self, *args: str, timeout: float = 300) -> str:
        if self.crane is None or self.proc is None:
            raise RegistryError("the local registry is not started")
        # No proxy for crane either: nothing but 127.0.0.1 is ever contacted.
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.dir), "NO_PROXY": HOST}
        r = subprocess.run([str(self.crane), *args, "--insecure"], capture_output=True,
                           text=True, timeout=timeout, env=env)
        if r.returncode != 0:
            raise RegistryError(f"crane {args[0]}: {' '.join(r.stderr.split())[-400:]}")
        return r.stdout.strip()

    def digest_ref(self, repo_tag: str) -> str:
        """`HOST:PORT/repo@sha256:...` of a pushed `repo:tag`."""
        repo = repo_tag.rsplit(":", 1)[0]
        return f"{self.host}/{repo}@{self._crane('digest', f'{self.host}/{repo_tag}')}"

    def push(self, archive: Path, repo_tag: str) -> str:
        """Push an image archive (docker-archive or OCI tarball, testbed/images.py's) as
        `repo:tag`; returns its reference by digest."""
        self._crane("push", str(archive), f"{self.host}/{repo_tag}")
        return self.digest_ref(repo_tag)

    def variant(self, repo_tag: str, new_tag: str, label: str) -> str:
        """A copy of a pushed image with one more config label: another image (its own
        digest and image id) sharing every layer; returns its reference by digest."""
        self._crane("mutate", "--label", label, f"{self.host}/{repo_tag}",
                    "-t", f"{self.host}/{new_tag}")
        return self.digest_ref(new_tag)

    def scratch(self, repo_tag: str, label: str) -> str:
        """Push a one-file image (no base, `label` in its config, so each call's digest is
        its own) as `repo:tag`, moving the tag if it exists; returns its reference by digest."""
        layer = self.dir / "scratch-layer.tar"
        data = label.encode()
        with tarfile.open(layer, "w") as tf:
            info = tarfile.TarInfo("task-id")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        self._crane("append", "-f", str(layer), "-t", f"{self.host}/{repo_tag}")
        self._crane("mutate", "--label", label, f"{self.host}/{repo_tag}")
        return self.digest_ref(repo_tag)

    def stop(self) -> None:
        """Stop the process and remove its data and containerd's entry for it."""
        if self.proc is not None:
            self.proc.stop(10)
            self.tb.components = [c for c in self.tb.components if c is not self.proc]
            self.tb._write_pids()
            self.proc = None
        if self.hosts_dir is not None:
            shutil.rmtree(self.hosts_dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)
