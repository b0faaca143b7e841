"""Run under .venv-frameworks' Python 3.12 (NeMo Gym's floor; the test venv has 3.11): NeMo
Gym's own code (its provider registry, which finds sandman through the distribution's entry
point; its `Sandbox` and `AsyncSandbox` facades; its mini-swe-agent sandbox environment)
driving sandman's provider. Prints one JSON object of what it found; the tests assert on it.

    python nemo_gym_checks.py refusals           # no controller: what is refused before a pod
    python nemo_gym_checks.py bed IMAGE WORKDIR  # $SANDMAN_URL: the controller on the test bed
    python nemo_gym_checks.py resume CHECKPOINT  # a sandbox made anew from a checkpoint
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym.sandbox import (
    AsyncSandbox,
    Sandbox,
    SandboxCreateError,
    SandboxSpec,
    create_provider,
    list_providers,
)
from responses_api_agents.mini_swe_agent_2.sandbox_environment import (
    MiniSWESandboxEnvironment,
    Submitted,
)

JOB = "nemo-gym-checks"
HOSTILE = "$(touch RAN)'\"`touch RAN2`; touch RAN4|"


def config(**kw: Any) -> dict:
    return {"sandman": {"job": JOB, "acquire_timeout_s": 60, **kw}}


async def refused(spec: SandboxSpec) -> str | None:
    sb = AsyncSandbox(config(url="http://127.0.0.1:9"), spec)  # nothing listens: no call
    try:
        await sb.start()
    except SandboxCreateError as e:
        return str(e)
    await sb.stop()
    return None


async def refusals() -> dict:
    image = "registry.invalid/swe/task:1"
    return {
        "providers": list_providers(),
        "class": type(create_provider(config())).__module__,
        "gpu": await refused(SandboxSpec(image=image, resources={"gpu": 1})),
        "option": await refused(SandboxSpec(image=image, provider_options={"snapshot": "x"})),
        "entrypoint": await refused(SandboxSpec(image=image, entrypoint=["sleep", "1"])),
        "bad_labels": await refused(SandboxSpec(image=image, provider_options={"labels": "x"})),
        "bad_job": await refused(SandboxSpec(image=image, provider_options={"job": 7})),
        "no_image": await refused(SandboxSpec()),
    }


async def facade(image: str, workdir: str) -> dict:
    """NeMo Gym's AsyncSandbox: start (files uploaded by NeMo Gym itself), commands, transfers,
    status, stop."""
    out: dict[str, Any] = {}
    provider = create_provider(config())
    spec = SandboxSpec(image=image, workdir=workdir, env={"GREETING": "hi"},
                       files={f"{workdir}/in/a.txt": "hello\n"}, ttl_s=600,
                       metadata={"nemo_gym_agent": "checks", "instance_id": "a/b c"},
                       resources={"cpu": 1, "memory_mib": 512})
    async with AsyncSandbox(provider, spec) as sb:
        await sb.start()
        r = await sb.exec('cat in/a.txt; echo "$GREETING $EXTRA"; pwd; exit 3',
                          env={"EXTRA": "there"})
        out["exec"] = [r.stdout, r.stderr, r.return_code, r.error_type]
        await sb.exec("cd /; export LEAK=1")
        r = await sb.exec('pwd; echo "${LEAK-none}"')
        out["isolated"] = r.stdout
        r = await sb.exec("pwd", cwd="/")
        out["cwd"] = r.stdout
        # An agent's variable values and cwd reach the command as data, never as shell.
        r = await sb.exec('printf %s "$X"', env={"X": HOSTILE}, cwd=f"{workdir}/in")
        ran = await sb.exec("ls -d RAN* in/RAN* /RAN* 2>/dev/null | wc -l")
        out["hostile"] = [r.stdout, r.return_code, ran.stdout.strip()]
        r = await sb.exec("true", cwd=f"{workdir}/$(touch RAN3)")
        out["hostile_cwd"] = [r.return_code, (await sb.exec("ls RAN3 2>&1")).return_code]
        r = await sb.exec("sleep 30", timeout_s=1)
        out["timeout"] = [r.return_code, r.error_type]
        r = await sb.exec("echo alive")
        out["after_timeout"] = r.stdout
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "up.bin"
            src.write_bytes(bytes(range(256)) * 4)
            await sb.upload(src, f"{workdir}/deep/er/up.bin")
            back = Path(tmp) / "back" / "up.bin"
            await sb.download(f"{workdir}/deep/er/up.bin", back)
            out["roundtrip"] = back.read_bytes() == src.read_bytes()
        out["status"] = (await sb.status()).value
        handle = sb._handle  # noqa: SLF001 - the provider's view after NeMo Gym's stop
    out["status_after_stop"] = (await provider.status(handle)).value
    await provider.close(handle)  # again, as a cleanup path may: no error
    await provider.aclose()
    return out


def sync_facade(image: str) -> dict:
    """NeMo Gym's sync Sandbox (its own loop runner thread) over the same provider."""
    with Sandbox(config()).start(SandboxSpec(image=image)) as sb:
        r = sb.exec("echo sync; false")
        return {"sync": [r.stdout, r.return_code], "status": sb.status().value}


def mini_swe(image: str, workdir: str) -> dict:
    """NeMo Gym's mini-swe-agent environment: commands in `cwd`, its submit sentinel."""
    out: dict[str, Any] = {}
    env = MiniSWESandboxEnvironment(image=image, cwd=workdir, provider=config(),
                                    instance_id="checks-1", env={"TASK": "greet"})
    with env:
        r = env.execute({"command": 'printf "def greet():\\n    return 1\\n" > greet.py; '
                                    'python3 -c "import greet; print(greet.greet())"; '
                                    'echo "$TASK"'})
        out["execute"] = [r["output"], r["returncode"]]
        r = env.execute("exit 7")
        out["failed"] = r["returncode"]
        try:
            env.execute("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the-patch")
            out["submitted"] = None
        except Submitted as s:
            out["submitted"] = s.messages[0]["extra"]["submission"]
    return out


def resume(checkpoint: str) -> dict:
    """A NeMo Gym sandbox made from a sandman checkpoint (provider option `checkpoint`): the
    checkpointed tree is there; a checkpoint that does not exist is a SandboxCreateError."""
    spec = SandboxSpec(provider_options={"checkpoint": checkpoint})
    with Sandbox(config()).start(spec) as sb:
        r = sb.exec("cat note.txt")
        found = {"note": [r.stdout, r.return_code]}
    other = checkpoint[:-1] + ("0" if checkpoint[-1] != "0" else "1")  # no such checkpoint
    # Stopped explicitly: NeMo Gym's sync Sandbox whose start failed otherwise stops in
    # __del__, at interpreter exit, on its loop thread already gone (a hang).
    box = Sandbox(config())
    try:
        box.start(SandboxSpec(provider_options={"checkpoint": other}))
        found["missing"] = None
    except SandboxCreateError as e:
        found["missing"] = str(e)
    finally:
        box.stop()
    return found


def main(argv: list[str]) -> int:
    faulthandler.dump_traceback_later(100, exit=True)  # a hang says where, before the test's
    if argv == ["refusals"]:
        print(json.dumps(asyncio.run(refusals())))
        return 0
    if len(argv) == 2 and argv[0] == "resume":
        assert os.environ.get("SANDMAN_URL"), "SANDMAN_URL is not set"
        print(json.dumps(resume(argv[1])))
        return 0
    if len(argv) == 3 and argv[0] == "bed":
        assert os.environ.get("SANDMAN_URL"), "SANDMAN_URL is not set"
        image, workdir = argv[1], argv[2]
        found = asyncio.run(facade(image, workdir))
        found.update(sync_facade(image))
        found.update(mini_swe(image, workdir))
        print(json.dumps(found))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
