"""`lazyrag` commands run as processes that start in milliseconds: one server process imports
lazyrag (and what random:tiny loads) once, then forks a child per command. Importing torch and
transformers takes most of a CLI run's seconds on a loaded machine; a test that starts the
command many times (to kill it) pays that once. A child is a whole process: SIGKILL ends it
as it would end `lazyrag` started from a shell.

The server reads one JSON request per line on stdin and answers one JSON value per line:
{"run": [args], "stderr": path} -> the child's pid; {"poll": pid} -> its exit code or null;
{"wait": pid} -> its exit code (negative: the signal that ended it, as subprocess says)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

SERVER = r"""
import json, os, sys, traceback
import lazyrag.cli, lazyrag.commands.index, lazyrag.commands.preflight
from lazyrag.models.presets import byte_tokenizer, preset_config
preset_config("tiny"), byte_tokenizer()  # transformers' lazy imports; no torch work before a fork

def child(args, stderr):
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.argv = ["lazyrag", *args]
    code = 1
    try:
        lazyrag.cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    if "run" in req:
        pid = os.fork()
        if pid == 0:
            child(req["run"], req["stderr"])
        reply = pid
    else:
        pid, status = os.waitpid(req.get("poll") or req["wait"], os.WNOHANG if "poll" in req else 0)
        reply = os.waitstatus_to_exitcode(status) if pid else None
    print(json.dumps(reply), flush=True)
"""


class ForkServer:
    """The server process; `run` starts a command in a child of it."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ask(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def run(self, args: list[str], stderr: str) -> Child:
        return Child(self, self.ask({"run": [str(a) for a in args], "stderr": str(stderr)}), stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()


class Child:
    """A forked command, with the parts of subprocess.Popen a test uses."""

    def __init__(self, server: ForkServer, pid: int, stderr: str):
        self.server, self.pid, self.stderr = server, pid, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"poll": self.pid})
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.server.ask({"wait": self.pid})
        return self.returncode

    def error_tail(self) -> str:
        with open(self.stderr) as f:
            return f.read()[-800:]
