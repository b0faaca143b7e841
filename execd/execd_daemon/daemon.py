"""The daemon: one shell, its commands and their timeouts, the environment, /reset, /state and
/conditions, and the parts (background processes, sessions, baseline) each route reaches."""

import collections
import errno
import os
import shutil
import signal
import socket
import stat
import threading
import time

from .base import (
    _ENV_NAME,
    CACHE_BYTES,
    DEFAULT_MAX_OUTPUT,
    DEFAULT_TIMEOUT,
    EXECD_TOKEN_ENV,
    INSTANCE_ENV,
    MAX_OUTPUT_LIMIT,
    PIPE_SIZE,
    READ_SIZE,
    TAG_VAR,
    VERSION,
    Activity,
    now,
    sh_quote,
)
from .procs import (
    Reaper,
    all_pids,
    become_subreaper,
    boot_ticks,
    clear_dumpable,
    exit_code_of,
    freeze,
    proc_cmdline,
    proc_stat,
    proc_tag,
    process_tree,
)
from .ready import ReadyCheck
from .shell import COMMAND_REDIRECTS, Capture, Shell, Teed, fix_diag, job_notices_only, parse_frame
from .wire import HTTPError, still_authorized


def open_null():
    """/dev/null as execd finds it at start, kept open for every shell's, spawn's and probe's
    stdin: a holder who can write /dev (root in the container) cannot swap a file of its own in
    for the next holder's commands. Anything but the null device refuses the start."""
    fd = os.open(os.devnull, os.O_RDWR | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(1, 3):
        os.close(fd)
        raise OSError(errno.EINVAL, "not the null device", os.devnull)
    return fd


class Daemon:
    def __init__(self, args):
        self.args = args
        self.started = now()
        self.instance = os.environ.get(INSTANCE_ENV) or os.urandom(6).hex()
        self.bash = shutil.which("bash") or "/bin/bash"
        self.workspace = args.workspace
        # Resolved once, at start: the holder may remove execd's cwd (the workspace without
        # --workspace, as in controller pods), and a removed cwd has no name (getcwd fails).
        self.start_cwd = os.path.realpath(os.getcwd())
        # The shell's first cwd, the base of relative paths and where /ready probes the disk.
        self.start_dir = self.workspace or self.start_cwd
        self.root = os.path.realpath(args.root)
        self.netguard_status = args.netguard_status
        self.kill_grace = args.kill_grace
        self.base_env = dict(os.environ)
        for k in (EXECD_TOKEN_ENV, INSTANCE_ENV):
            self.base_env.pop(k, None)
        # What fresh commands start with: never what /env or a restore set since.
        self.start_env = dict(self.base_env)
        self.null_fd = open_null()
        self.reaper = Reaper()
        self.subreaper = become_subreaper()
        self.exec_lock = threading.Lock()
        self.files_lock = threading.Lock()
        self.cache_lock = threading.Lock()
        self.cache = collections.OrderedDict()  # request_id -> [event, response]
        self.cache_max = 512
        self.cache_bytes = 0
        self.resetting = False
        self.stopping = False  # SIGTERM: the pod is going away (main.py)
        self.calls = 0
        self.shell = None
        self.retired = None  # why this execd starts no shell any more (a failed restore)
        self.token_gen = 0  # bumped at each /token rotation (still_authorized)
        self.activity = Activity()  # the holder's last request (GET /activity)
        self.probe_lock = threading.Lock()  # /ready's named probe file vs the baseline walk
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.ready = ReadyCheck(self)
        # Background processes and sessions, made by their first use: their modules are CPU
        # at every sandbox start that most sandboxes never need (docs/execd.md "Layout").
        self._bg = self._pty = None
        self._parts_lock = threading.Lock()
        # Set once make_undumpable() ran (main starts it once execd listens); a token is
        # checked only after, so no holder's token is read into a dumpable execd.
        self.undumpable = threading.Event()
        self.start_shell()

    @property
    def bg(self):
        if self._bg is None:
            with self._parts_lock:
                if self._bg is None:
                    from .background import Background

                    self._bg = Background(self)
        return self._bg

    @property
    def pty(self):
        if self._pty is None:
            with self._parts_lock:
                if self._pty is None:
                    from .sessions import Sessions

                    self._pty = Sessions(self)
        return self._pty

    def make_undumpable(self):
        """Clear execd's dumpable flag (procs.clear_dumpable), off the start's path: ctypes
        costs start CPU under the pod's quota. A token is accepted only once this ran."""
        try:
            clear_dumpable()
        finally:
            self.undumpable.set()

    def start_shell(self, bash=None):
        if self.retired:
            raise HTTPError(503, "retired: %s" % self.retired, {"retired": True})
        sh = Shell(self)
        sh.spawn(bash or self.bash)
        self.shell = sh

    def restart_shell(self):
        if self.shell is not None:
            self.shell.kill()
        self.start_shell()

    # ------------------------------------------------------------ process sets

    def sandbox_pids(self):
        """Every process of the sandbox but execd: all of them when we are PID 1, else our
        descendants (orphans land on us as subreaper) and anything carrying our tag."""
        me = os.getpid()
        pids = all_pids()
        if me == 1:
            own = self.own_pids()
            return [p for p in pids if p != me and p not in own]
        info, out = process_tree(pids, me)
        prefix = self.instance + "-"
        for p in info:
            if p not in out and p != me:
                tag = proc_tag(p)
                if tag is not None and tag.startswith(prefix):
                    out.add(p)
        out.discard(me)
        return sorted(out - self.own_pids())

    def call_pids(self, tag, root, since_ticks):
        """The processes of one call: those carrying its tag anywhere, plus untagged processes
        started since the call began whose parent is the shell, execd or another process of the
        call. execd is PID 1 or a subreaper, so a child that left the session, dropped the tag
        (`env -i setsid -f ...`) and was orphaned is re-parented to execd and still found; forked
        subshells never exec, so carry no tag either. A process of an earlier call (its tag, or
        untagged and older than this call) is never entered: earlier background jobs and their
        children stay."""
        me = os.getpid()
        shell_pid = root if root != me else None
        info, _ = process_tree(all_pids(), -1)
        children = collections.defaultdict(list)
        for p, s in info.items():
            children[s[0]].append(p)
        skip = self.own_pids()
        tags = {}
        out = set()
        for p, s in info.items():
            if p == me or p == shell_pid or p in skip or s[1] == "Z":
                continue
            t = tags[p] = proc_tag(p)
            if t == tag:
                out.add(p)
        # Ancestry: from the shell and from execd (orphans), through this call's processes only.
        stack = [me] + ([shell_pid] if shell_pid is not None else [])
        seen = set(stack)
        while stack:
            for c in children.get(stack.pop(), ()):
                if c in seen or c == shell_pid or c in skip:
                    continue
                seen.add(c)
                s = info[c]
                t = tags.get(c)
                mine = t == tag or (t is None and (since_ticks is None or s[2] >= since_ticks))
                if not mine:
                    continue
                if s[1] != "Z":
                    out.add(c)
                stack.append(c)
        return out

    def own_pids(self):
        """execd's own helper processes (the readiness check's fork): never a call's."""
        with self.ready.lock:
            return set(self.ready.pids)

    def kill_pids(self, pids, sig):
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_sandbox(self, keep=()):
        """SIGKILL every sandbox process (rounds, since they may fork meanwhile) and reap;
        all stopped first, so none acts on another's death (a `|| touch x` of its own)."""
        sh = self.shell
        if sh is not None and sh.pid not in keep:
            sh.unreaped(lambda: freeze(lambda: (), sh.pid))
        freeze(lambda: [p for p in self.sandbox_pids() if p not in keep])
        deadline = now() + 10
        while now() < deadline:
            pids = [p for p in self.sandbox_pids() if p not in keep]
            alive = []
            for p in pids:
                s = proc_stat(p)
                if s is not None and s[1] != "Z":
                    alive.append(p)
            self.reaper.reap()
            if not alive:
                if not [p for p in pids if proc_stat(p) is not None]:
                    return True
                time.sleep(0.005)
                continue
            self.kill_pids(alive, signal.SIGKILL)
            time.sleep(0.005)
        return False

    # ------------------------------------------------------------ exec

    def exec_args(self, req):
        """The checked (command bytes, timeout, max_output, idle_timeout) of an exec body."""
        cmd = req.get("command")
        if not isinstance(cmd, str):
            raise HTTPError(400, "command must be a string")
        timeout = req.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout <= 7 * 86400):
            raise HTTPError(400, "timeout must be a number of seconds in (0, 604800]")
        idle = req.get("idle_timeout")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                                 or not 0 < idle <= 7 * 86400):
            raise HTTPError(400, "idle_timeout must be a number of seconds in (0, 604800]")
        max_output = req.get("max_output", DEFAULT_MAX_OUTPUT)
        if isinstance(max_output, bool) or not isinstance(max_output, int) or not (
                0 <= max_output <= MAX_OUTPUT_LIMIT):
            raise HTTPError(400, "max_output must be an integer in [0, %d]" % MAX_OUTPUT_LIMIT)
        try:
            data = cmd.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, "command is not valid unicode") from None
        if b"\0" in data:
            raise HTTPError(400, "command contains a NUL byte")
        return data, float(timeout), max_output, None if idle is None else float(idle)

    def exec_command(self, req, sock=None):
        data, timeout, max_output, idle = self.exec_args(req)
        alone = req.get("fresh", False)
        if not isinstance(alone, bool):
            raise HTTPError(400, "fresh must be true or false")
        cwd = req.get("cwd")
        if alone:
            from .fresh import check_cwd

            check_cwd(cwd)
        elif cwd is not None:
            raise HTTPError(400, "cwd is for fresh commands (the shell's is its own)")
        rid = req.get("request_id")
        if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
            raise HTTPError(400, "request_id must be a non-empty string of at most 256 chars")
        entry = None
        if rid is not None:
            with self.cache_lock:
                entry = self.cache.get(rid)
                if entry is None:
                    entry = [threading.Event(), None]
                    self.cache[rid] = entry
                    fresh = True
                else:
                    fresh = False
            if not fresh:
                # A retry: the stored answer, or wait for the first attempt's.
                if not entry[1] and not entry[0].wait(timeout + 60):
                    raise HTTPError(504, "the first attempt of this request_id is still running")
                if entry[1] is None:
                    raise HTTPError(409, "busy")
                return entry[1]
        if not self.exec_lock.acquire(False):
            if entry is not None:
                with self.cache_lock:
                    self.cache.pop(rid, None)
                entry[0].set()
            raise HTTPError(409, "busy", {"busy": True})
        try:
            still_authorized(self)
            if alone:
                from .fresh import run_fresh

                resp = run_fresh(self, data, timeout, max_output, idle, cwd, sock)
            else:
                resp = self._run_checked(data, timeout, max_output, idle)
        except BaseException:
            if entry is not None:
                with self.cache_lock:
                    self.cache.pop(rid, None)
                entry[0].set()
            raise
        finally:
            self.exec_lock.release()
        if entry is not None:
            entry[1] = resp
            entry[0].set()
            with self.cache_lock:
                # Bounded in count and in bytes: stored outputs must not grow execd's RSS.
                self.cache_bytes += len(resp["output"])
                while len(self.cache) > self.cache_max or self.cache_bytes > CACHE_BYTES:
                    k, e = next(iter(self.cache.items()))
                    if e[1] is None:
                        break
                    self.cache.pop(k)
                    self.cache_bytes -= len(e[1]["output"])
        return resp

    def _run_checked(self, data, timeout, max_output, idle=None, stream=None):
        r = self._run(data, timeout, max_output, idle, stream)
        notices = r.pop("notices", None)
        if notices is not None:
            # Only a job notice (a job died between the flush and the check) reached the check:
            # nothing ran, so run the command again, once, with the notice as output.
            if stream is not None:
                stream.output(notices.encode("utf-8", "replace") + b"\n")
            r = self._run(data, timeout, max_output, idle, stream)
            r.pop("notices", None)
            r["output"] = notices + "\n" + r["output"]
        return r

    def stream_command(self, req, stream):
        """An exec whose output also goes to `stream` as it is read (ExecStream); the answer
        is /exec's. One command at a time with /exec (409 busy)."""
        data, timeout, max_output, idle = self.exec_args(req)
        if req.get("request_id") is not None:
            raise HTTPError(400, "request_id is for /exec: a stream is never replayed")
        if req.get("fresh") or req.get("cwd") is not None:
            raise HTTPError(400, "fresh and cwd are for /exec")
        kill = req.get("kill_on_disconnect", False)
        if not isinstance(kill, bool):
            raise HTTPError(400, "kill_on_disconnect must be true or false")
        stream.kill_on_disconnect = kill
        if not self.exec_lock.acquire(False):
            raise HTTPError(409, "busy", {"busy": True})
        try:
            still_authorized(self)
            stream.begin()
            return self._run_checked(data, timeout, max_output, idle, stream)
        finally:
            self.exec_lock.release()

    def _ensure_shell(self):
        sh = self.shell
        if sh is None or sh.dead():
            st = sh.exit_status() if sh is not None else None
            if sh is not None:
                sh.close()
            self.start_shell()
            if st is not None:
                return ("the shell had exited (status %d) since the last call; a new shell was "
                        "started, state lost" % exit_code_of(st))
        return None

    def _run(self, data, timeout, max_output, idle=None, stream=None):
        t0 = now()
        # A process started in this tick or later may be the call's (10 ms ticks).
        since0 = boot_ticks()
        notice = self._ensure_shell()
        sh = self.shell
        if sh.note:  # said once, by the first call the shell runs
            notice = "; ".join(x for x in (notice, sh.note) if x)
            sh.note = None
        sh.resume()
        self.calls += 1
        tag = "%s-%d" % (self.instance, self.calls)
        marker = ("@" + os.urandom(8).hex()).encode()
        cap = Capture(max_output)
        if stream is not None:
            cap = Teed(cap, stream)
        if sh.pending_out:
            cap.add(sh.pending_out)
            sh.pending_out = bytearray()
        # Late bytes on the status and diagnostic pipes belong to no call: drop them.
        for _ in range(64):
            if not sh.read_avail(sh.st_r, 65536):
                break
        sh.read_diag()
        line = b"".join((
            b"__sm_r=1 __sm_m=", marker, b"; ", TAG_VAR.encode(), b"=", tag.encode(),
            b"; __sm_c=", sh_quote(data),
            b"; __sm_chk && builtin eval \"$__sm_c\" ", COMMAND_REDIRECTS, b"; __sm_fin $?\n"))
        since = None  # in /proc start-time ticks; needed only on a timeout
        result = {"exit_code": None, "output": "", "truncated": False, "duration_ms": 0.0,
                  "error": None}
        status = bytearray()
        frame = None
        errors = []
        deadline = t0 + timeout
        ended = None  # why the command was killed: "timeout", "idle" or "disconnect"
        seen = cap.total  # output bytes read so far; more of them push the idle deadline
        idle_at = t0 + idle if idle else None
        phase = "run"  # run -> kill (frozen, killed, the shell told to skip the rest) -> frame
        phase_at = 0.0
        dead_st = None
        buf = sh.buf
        bufview = memoryview(buf)
        inview = memoryview(line)
        # With a pidfd, shell death wakes the poll; without one (python 3.8) we look every 50 ms.
        poll_s = 0.05 if sh.pidfd is None else 1.0
        last_look = t0
        while True:
            if inview:
                try:
                    n = os.write(sh.in_w, inview[:65536])
                    inview = inview[n:]
                except BlockingIOError:
                    pass
                except OSError:
                    inview = inview[:0]
            t = now()
            if phase == "run":
                wake = deadline if idle_at is None else min(deadline, idle_at)
                if stream is not None and stream.kill_on_disconnect:
                    wake = min(wake, last_look + 0.05)
            else:
                wake = phase_at + 2.0
            wait = 0.001 if inview else min(poll_s, max(0.0, wake - t))
            events = sh.poller.poll(int(wait * 1000) + (1 if wait > 0 else 0))
            for fd, _ev in events:
                if fd == sh.out_r:
                    self._drain(sh, cap, buf, bufview, 64)
                elif fd == sh.st_r:
                    got = sh.read_avail(sh.st_r, self.args.status_read_size)
                    if got:
                        status += got
                        frame = parse_frame(status, marker)
            if frame is not None and frame[0] != "need":
                break
            t = now()
            if idle_at is not None and cap.total != seen:
                seen, idle_at = cap.total, t + idle
            if not events or t - last_look >= 0.05 or any(fd == sh.pidfd for fd, _ in events):
                if sh.dead():
                    dead_st = sh.exit_status()
                    break
                if not self.resetting:  # a reset's freeze must hold until its kill
                    sh.resume()
            if phase == "run":
                if t >= deadline:
                    ended = "timeout"
                elif idle_at is not None and t >= idle_at:
                    ended = "idle"
                elif stream is not None and t - last_look >= 0.05 and stream.abandoned():
                    ended = "disconnect"
            if phase == "run" and ended is not None:
                phase, phase_at, last_look, since = "kill", t, t, since0
                frame = self._end_call(sh, tag, since, status, marker)
                if frame[0] != "need":
                    break
            elif phase == "kill" and t >= phase_at + 2.0:
                break
            if t - last_look >= 0.05:
                last_look = t
        timed_out = phase != "run"
        if frame is not None and frame[0] == "ok" and timed_out:
            # Forked by the shell after the kill and before its skip began (a simple command
            # whose $(...) was killed): too late to be frozen, still killed.
            self._kill_call(tag, sh.pid, since)
        self._drain(sh, cap, buf, bufview, PIPE_SIZE // READ_SIZE + 1)
        result["output"] = cap.text()
        result["truncated"] = cap.truncated
        if dead_st is not None:
            code = exit_code_of(dead_st)
            # Its children are ours now (subreaper): the call's, tagged or started since, go.
            since = since0
            self._kill_call(tag, os.getpid(), since)
            # A killed command whose shell then died (set -e: bash exits on the killed child's
            # status before any trap of ours can run) is still the kill's 124.
            result["exit_code"] = 124 if timed_out else code
            msg = "shell exited (status %d); a new shell was started, state lost" % code
            if frame is not None and status:
                msg = "incomplete frame: " + msg
            if self.resetting:
                msg += " (reset)"
            errors.append(msg)
            sh.close()
            if not self.resetting:
                self.start_shell()
        elif frame is not None and frame[0] == "expanding":
            errors.append(frame[1])
            result["exit_code"] = 124
            self._kill_call(tag, os.getpid(), since)  # orphaned to us, as subreaper
            self.restart_shell()
        elif frame is None or frame[0] != "ok":
            why = frame[1] if frame is not None and frame[0] == "invalid" else None
            if why is not None:
                errors.append("invalid frame (%s); the shell was restarted, state lost" % why)
            elif status:
                errors.append("incomplete frame; the shell was restarted, state lost")
            else:
                errors.append("no exit status after the kill; the shell was restarted, state "
                              "lost")
            held = sh.freeze(lambda: self.call_pids(tag, sh.pid, since))
            self._kill_call(tag, sh.pid, since)
            result["exit_code"] = 124 if timed_out else -1
            self.restart_shell()
            sh.thaw(held)
        elif frame[1] == "E":
            result["exit_code"] = 2
            diag = fix_diag(sh.read_diag(), sh.line_offset)
            if not diag:
                # The check's own plumbing failed (say, fd 61 closed): a fresh shell fixes it.
                diag = "the syntax check failed without a diagnosis; the shell was restarted"
                self.restart_shell()
            elif job_notices_only(diag):
                result["notices"] = diag
            errors.append(diag)
        else:
            result["exit_code"] = 124 if timed_out else frame[2]
        if ended == "timeout":
            errors.insert(0, "timeout after %gs; the command's processes were killed" % timeout)
        elif ended == "idle":
            # "timeout" first: the SDK reads an execd timeout as exit 124 with that prefix.
            errors.insert(0, "timeout: no output for %gs (idle_timeout); the command's "
                             "processes were killed" % idle)
        elif ended == "disconnect":
            errors.insert(0, "the stream's client went away (kill_on_disconnect); the "
                             "command's processes were killed")
        if notice:
            errors.append(notice)
        result["error"] = "; ".join(errors) if errors else None
        result["duration_ms"] = round((now() - t0) * 1000.0, 3)
        return result

    def _drain(self, sh, cap, buf, bufview, max_reads):
        for _ in range(max_reads):
            try:
                n = os.readv(sh.out_r, [buf])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if n <= 0:
                return
            cap.add(bufview[:n])
            if n < len(buf):
                return

    def _end_call(self, sh, tag, since, status, marker):
        """A killed command ends whole, no part of it acting on another's death: freeze the
        shell and the call's processes, SIGKILL all but the shell, tell the stopped shell to
        skip the rest of the command (unless its frame is in: then it finished; or it reads a
        substitution: then it dies too), continue it. Returns the frame after the freeze."""
        held = sh.freeze(lambda: self.call_pids(tag, sh.pid, since))
        status += sh.read_avail(sh.st_r, 4096)
        frame = parse_frame(status, marker)
        expanding = frame[0] == "need" and not status and sh.expanding()
        if frame[0] == "need" and not status and not expanding:
            sh.abort()
        self._kill_call(tag, sh.pid, since)
        if expanding:  # killed while still stopped: it acts on nothing
            sh.unreaped(lambda: os.kill(sh.pid, signal.SIGKILL))
            frame = ("expanding", expanding, None)
        sh.thaw(held)
        return frame

    def _kill_call(self, tag, root, since):
        for _ in range(20):
            pids = self.call_pids(tag, root, since)
            if not pids:
                return
            self.kill_pids(pids, signal.SIGKILL)
            time.sleep(0.005)
            self.reaper.reap()

    # ------------------------------------------------------------ internal shell calls

    def internal(self, script, timeout=30.0):
        """Run our own (trusted, checked) bash at the shell's top level; stdout bytes."""
        if not self.exec_lock.acquire(False):
            raise HTTPError(409, "busy", {"busy": True})
        if not isinstance(script, bytes):
            script = script.encode("utf-8")
        try:
            r = self._run_checked(script, timeout, MAX_OUTPUT_LIMIT)
        finally:
            self.exec_lock.release()
        if r["exit_code"] != 0 or r["error"]:
            raise HTTPError(500, "shell call failed: %s" % (r["error"] or r["exit_code"]))
        return r["output"]

    def set_env(self, req):
        still_authorized(self)
        sets = req.get("set", {})
        unsets = req.get("unset", [])
        if not isinstance(sets, dict) or not isinstance(unsets, list):
            raise HTTPError(400, "set must be an object and unset a list")
        parts = []
        for k, v in sets.items():
            if not _ENV_NAME.match(k) or k.startswith("__sm_") or k == TAG_VAR:
                raise HTTPError(400, "invalid variable name %r" % k[:100])
            if not isinstance(v, str) or "\0" in v:
                raise HTTPError(400, "value of %s must be a string without NUL" % k)
            parts.append("export %s=%s" % (k, sh_quote(v.encode("utf-8", "surrogatepass"))
                                           .decode("utf-8", "surrogatepass")))
        for k in unsets:
            if not isinstance(k, str) or not _ENV_NAME.match(k) or k.startswith("__sm_"):
                raise HTTPError(400, "invalid variable name %r" % (str(k)[:100],))
            parts.append("unset -v %s" % k)
        parts.append("while IFS= read -r __sm_e; do builtin printf '%s=%s\\0' \"$__sm_e\" "
                     "\"${!__sm_e}\"; done < <(compgen -e); unset -v __sm_e")
        try:
            out = self.internal("\n".join(parts))
        except UnicodeEncodeError:
            raise HTTPError(400, "values must be valid unicode") from None
        # Later shells (after a crash, timeout or reset) start with the same environment.
        for k, v in sets.items():
            self.base_env[k] = v
        for k in unsets:
            self.base_env.pop(k, None)
        env = {}
        for item in out.split("\0"):
            if "=" in item:
                k, v = item.split("=", 1)
                if k != TAG_VAR:
                    env[k] = v
        return {"env": env}

    def reset(self, req):
        still_authorized(self)
        wipe = req.get("workspace", False)
        if not isinstance(wipe, bool):
            raise HTTPError(400, "workspace must be a boolean")
        if wipe and not self.workspace:
            raise HTTPError(400, "no workspace configured (--workspace); nothing to wipe")
        t0 = now()
        self.resetting = True
        try:
            with self.bg.lock, self.pty.lock:
                pass  # a spawn or open under way ends first; later ones see `resetting`
            self.kill_sandbox()
            if not self.exec_lock.acquire(True, 30):
                raise HTTPError(503, "a command did not stop for the reset")
            try:
                if self.shell is not None:
                    self.shell.close()
                    self.shell = None
                clean = self.kill_sandbox()
                self.bg.reset()
                self.pty.reset()
                wiped = None
                if wipe:
                    wiped = self._wipe(self.workspace)
                self.reaper.reap()
                self.start_shell()
                left = [p for p in self.sandbox_pids() if p != self.shell.pid]
            finally:
                self.exec_lock.release()
        finally:
            self.resetting = False
        with self.cache_lock:
            self.cache.clear()
            self.cache_bytes = 0
        return {"ok": clean and not left, "left": left, "shell_pid": self.shell.pid,
                "workspace_wiped": wiped, "duration_ms": round((now() - t0) * 1000, 3)}

    def _wipe(self, path):
        """Empties the workspace (the path as configured; below it, never through a symlink):
        any depth, within REMOVE_MAX_S. Returns how many entries it held."""
        from .trees import REMOVE_MAX_S, remove_tree

        deadline = now() + REMOVE_MAX_S
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            names = os.listdir(fd)
            for name in names:
                remove_tree(fd, name, deadline)
        finally:
            os.close(fd)
        return len(names)

    # ------------------------------------------------------------ state and conditions

    def state(self):
        sh = self.shell
        cwd = None
        if sh is not None:
            try:
                cwd = os.readlink("/proc/%d/cwd" % sh.pid)
            except OSError:
                cwd = None
        procs = []
        for p in self.sandbox_pids():
            s = proc_stat(p)
            if s is None:
                continue
            procs.append({"pid": p, "ppid": s[0], "state": s[1], "cmd": proc_cmdline(p),
                          "shell": sh is not None and p == sh.pid})
        return {"version": VERSION, "pid": os.getpid(),
                "shell_pid": sh.pid if sh is not None else None, "cwd": cwd,
                "busy": self.exec_lock.locked(), "processes": procs,
                "reaper": self.subreaper, "guard": self.guard_status(),
                "uptime_s": round(now() - self.started, 3),
                "shell_uptime_s": round(now() - sh.started, 3) if sh is not None else None}

    def guard_status(self):
        try:
            with open(self.netguard_status, "rb") as f:
                raw = f.read(1 << 20)
        except FileNotFoundError:
            return None
        except OSError as e:
            return {"error": "unreadable: %s" % e.strerror}
        import json  # here, not at start (the imports at the top say why)

        try:
            return json.loads(raw.decode("utf-8"))
        except ValueError:
            return {"error": "unreadable: not JSON"}

    def conditions(self, query):
        from .conditions import (
            cpu_limits,
            egress_probe,
            guard_allowlist,
            memory_limit,
            time_zone,
            user_info,
            visible_cpus,
        )

        root = getattr(self.args, "conditions_root", "/") or "/"
        sh = self.shell
        out = {}
        out.update(cpu_limits(root))
        out.update(visible_cpus(root, sh.pid if sh is not None else None))
        out.update(memory_limit(root))
        out.update(user_info(root))
        out["tz_env"] = self.base_env.get("TZ")
        out.update(time_zone(root, out["tz_env"]))
        # Unset means Python picks a random seed per process: that is a reading too (None).
        out["pythonhashseed"] = self.base_env.get("PYTHONHASHSEED")
        try:
            out["hostname"] = socket.gethostname()
        except OSError:
            out["hostname"] = None
        g = self.guard_status()
        out["netguard_mode"] = (g.get("mode") if isinstance(g, dict) and g.get("ok") is True
                                and isinstance(g.get("mode"), str) else None)
        out["netguard_allow_egress"] = guard_allowlist(g)
        probe = query.get("egress_probe")
        out["egress"] = egress_probe(probe[-1]) if probe else None
        return out
