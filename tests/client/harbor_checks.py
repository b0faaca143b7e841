"""Run by tests/client/test_harbor.py under .venv-frameworks' Python 3.12 (Harbor's floor; the
test venv has 3.11): Harbor's own environment factory building sandman's environment from task
configurations, then one environment's calls against a real execd on 127.0.0.1. Prints one
JSON object of what it found; the test asserts on it.

    python harbor_checks.py WORKDIR [ADDRESS PORT TOKEN]
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import sys
from pathlib import Path

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from sandman.client import AsyncSandbox

CLASS = "sandman.client.harbor:SandmanEnvironment"


def build(task: Path, cfg: EnvironmentConfig, **kw):
    (task / "environment").mkdir(parents=True, exist_ok=True)
    return EnvironmentFactory.create_environment_from_import_path(
        CLASS, environment_dir=task / "environment", environment_name=task.name,
        session_id=f"{task.name}__abc__env", trial_paths=TrialPaths(trial_dir=task / "trial"),
        task_env_config=cfg, **kw)


def refused(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the finding is the refusal itself
        return f"{type(e).__name__}: {e}"
    return None


def refusals(work: Path) -> dict:
    out: dict = {}
    dockerfile = work / "dockerfile"
    (dockerfile / "environment").mkdir(parents=True)
    (dockerfile / "environment" / "Dockerfile").write_text("FROM debian\n")
    out["dockerfile_only"] = refused(lambda: build(dockerfile, EnvironmentConfig()))
    compose = work / "compose"
    (compose / "environment").mkdir(parents=True)
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    out["compose"] = refused(lambda: build(compose, EnvironmentConfig(docker_image="a/b:1")))
    out["windows"] = refused(lambda: build(work / "win", EnvironmentConfig(
        docker_image="a/b:1", os="windows")))
    out["allowlist"] = refused(lambda: build(work / "allow", EnvironmentConfig(
        docker_image="a/b:1"), network_policy=NetworkPolicy(
            network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org"])))
    out["bad_kwarg"] = refused(lambda: build(work / "kw", EnvironmentConfig(
        docker_image="a/b:1"), acquire_timeout_s="soon"))
    env = build(work / "ok", EnvironmentConfig(docker_image="a/b:1"), image="c/d:2")
    out["image"] = env.image
    out["not_started"] = refused(lambda: asyncio.run(env.exec("true")))
    return out


async def live(work: Path, address: str, port: int, token: str) -> dict:
    out: dict = {}
    env = build(work / "live", EnvironmentConfig(docker_image="a/b:1"))
    env.sandbox = AsyncSandbox.connect(address, port, token)
    try:
        # A working directory and variables an attacker chose: quotes, $(...), backticks.
        cwd = work / "dir with 'quote' and $(touch CWD_RAN)"
        hostile = "$(touch ENV_RAN)'\"`touch ENV_RAN2`; touch ENV_RAN3"
        await env.upload_file(work / "payload", f"{cwd}/sub/f.txt")  # parents made
        r = await env.exec('printf "%s|" "$V"; pwd', cwd=str(cwd), env={"V": hostile})
        out["hostile"] = [r.stdout, r.return_code, str(cwd)]
        out["ran"] = sorted(str(p.relative_to(work)) for p in work.rglob("*")
                            if p.name in ("CWD_RAN", "ENV_RAN", "ENV_RAN2", "ENV_RAN3"))
        out["uploaded"] = (cwd / "sub" / "f.txt").read_text()
        # Each exec starts anew, as docker exec: no cd or export reaches the next.
        await env.exec("cd / && export X=1", cwd=str(work))
        r = await env.exec("echo ${X:-unset}; pwd", cwd=str(work))
        out["isolated"] = r.stdout
        r = await env.exec("echo out; echo err >&2; exit 3")
        out["streams"] = [r.stdout, r.stderr, r.return_code]
        try:
            await env.exec("sleep 30", timeout_sec=1)
            out["timeout"] = None
        except RuntimeError as e:
            out["timeout"] = str(e)
        out["after_timeout"] = (await env.exec("echo alive")).stdout
        # Two at once: execd has one shell, so the second waits instead of failing busy.
        both = await asyncio.gather(env.exec("sleep 0.5; echo one"), env.exec("echo two"))
        out["concurrent"] = [r.stdout for r in both]
        # Trees both ways, through Harbor's own download_dir_filtered too.
        tree = work / "tree"
        (tree / "a" / "b").mkdir(parents=True)
        (tree / "a" / "b" / "deep.txt").write_text("deep\n")
        (tree / "top.sh").write_text("#!/bin/sh\n")
        (tree / "top.sh").chmod(0o755)
        await env.upload_dir(tree, str(work / "remote"))
        await env.download_dir(str(work / "remote"), work / "back")
        out["tree"] = [(work / "back" / "a" / "b" / "deep.txt").read_text(),
                       os.access(work / "back" / "top.sh", os.X_OK)]
        await env.download_dir_filtered(source_dir=str(work / "remote"),
                                        target_dir=work / "filtered", include=["a/**"])
        out["filtered"] = sorted(str(p.relative_to(work / "filtered"))
                                 for p in (work / "filtered").rglob("*") if p.is_file())
        await env.download_file(str(work / "remote" / "top.sh"), work / "dl" / "x" / "top.sh")
        out["file"] = (work / "dl" / "x" / "top.sh").read_text()
        out["is_dir"] = [await env.is_dir(str(work / "remote")),
                         await env.is_file(str(work / "remote"))]
        # Users: the sandbox's own as is; another through runuser when it runs as root.
        me = getpass.getuser()
        out["user_self"] = (await env.exec("id -un", user=me)).stdout
        try:
            out["user_other"] = (await env.exec("id -un", user="nobody")).stdout
        except ValueError as e:
            out["user_other"] = f"ValueError: {e}"
        out["root"] = os.geteuid() == 0
    finally:
        env.sandbox = None
    return out


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    out = {"refusals": refusals(work)}
    if len(argv) == 4:
        (work / "payload").write_text("payload\n")
        out["live"] = asyncio.run(live(work, argv[1], int(argv[2]), argv[3]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
