"""A trainer on this host, run in a trainer pod's network namespace (nsenter -n, the host's
files and this venv, so mini-swe-agent is installed): `DefaultAgent` with mini-swe-agent's
deterministic test model in a `SandmanEnvironment` acquired from the installed controller.

    python tests/e2e/minisweagent_trainer.py URL CLUSTER_IP TOKEN CA_FILE IMAGE TASK_DIR

There is no cluster DNS in the namespace: the controller's Service is dialled at its cluster
IP while TLS verifies the Service's name (URL's host). One line `E2E-RESULT {json}` at the end.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.parse

import httpx
import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from sandman.client import Client
from sandman.client.minisweagent import SandmanEnvironment

REPO = "/work/mini"
SOLVED = "def greet():\n    return 'hello sandman'\n"


class _Dial(httpx.HTTPTransport):
    """Connects to `ip`, keeps the URL's name for SNI, certificate check and Host."""

    def __init__(self, ip: str, name: str, **kw) -> None:
        super().__init__(**kw)
        self.ip, self.name = ip, name

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host=self.ip)
        request.extensions = {**request.extensions, "sni_hostname": self.name}
        return super().handle_request(request)


def main(argv: list[str]) -> int:
    url, ip, token, ca, image, task = argv
    name = urllib.parse.urlsplit(url).hostname
    dial = _Dial(ip, name, verify=ssl.create_default_context(cafile=ca))
    res: dict = {}
    with Client(url, token=token, transport=dial, timeout_s=60) as client:
        t0 = time.monotonic()
        env = SandmanEnvironment(client=client, image=image, job="e2e-mini", cpu="250m",
                                 memory="256Mi", acquire_timeout_s=150, cwd=REPO, timeout=20)
        try:
            res["acquire_s"] = time.monotonic() - t0
            sb = env.sandbox
            res["pod"] = sb.pod
            sb.upload_tree(task, REPO)
            model = DeterministicModel(outputs=[
                make_output("read", [{"command": "cat pkg/greet.py"}]),
                make_output("edit", [{"command": "sed -i 's/hello world/hello sandman/' "
                                                  "pkg/greet.py"}]),
                make_output("test", [{"command": "python3 -c 'import pkg.greet as g; "
                                                  "assert g.greet() == \"hello sandman\"' && "
                                                  "echo tested"}]),
                make_output("fail", [{"command": "ls /nonexistent-dir"}]),
                make_output("hang", [{"command": "sleep 60"}]),
                make_output("submit", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT "
                                                    "&& cat pkg/greet.py"}]),
            ])
            cfg = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())["agent"]
            agent = DefaultAgent(model, env, **{**cfg, "cost_limit": 0, "step_limit": 20})
            env.config.timeout = 3  # the hanging step's
            t0 = time.monotonic()
            res["result"] = agent.run("greet sandman")
            res["run_s"] = time.monotonic() - t0
            res["observations"] = [m["content"] for m in agent.messages
                                   if m["role"] == "user"][1:]
            res["file"] = sb.read(f"{REPO}/pkg/greet.py").decode()
            res["uname"] = sb.exec("uname -r").output.strip()
            res["system_info"] = agent.messages[1]["content"]
        finally:
            env.cleanup()
        res["released"] = env.sandbox is None and sb.released
    print("E2E-RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
