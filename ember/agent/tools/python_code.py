"""A Python code runner tool: the model's code runs in a fresh interpreter in a subprocess, under limits.

What is enforced (Linux), per call:
- time: the wall-clock limit `timeout` (seconds; the process group is killed at it) and the same CPU-time
  limit (RLIMIT_CPU);
- memory: the address-space limit `memory_mb` (RLIMIT_AS: an allocation past it raises MemoryError in the code);
- files: the code runs in an empty temporary folder that is deleted afterwards, and no file it writes (its
  output included) may exceed `max_file_mb` (RLIMIT_FSIZE);
- network: with `isolate_network` (the default) the code runs in a new user and network namespace, which
  has no interface but a loopback that is down, so no connection leaves it; the tool checks at start that
  the kernel allows this and refuses to load otherwise (set `isolate_network: false` to run without it,
  with only the proxy variables removed);
- environment: only PATH, LANG and HOME (the temporary folder) are passed: no proxies, no credentials.
Not enforced: processes the code starts count against the same limits per process, not together; the
filesystem outside the folder is readable and, where the user may write, writable. Use a container for
untrusted code at scale.

A limit reached (time, CPU, file size) raises, so the agent loop reports the call as a failed tool call; an
exception inside the code is an ordinary answer (its traceback is what the model reads).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ember.agent.tools.base import BaseTool, ToolResponse
from ember.errors import UserError

_BOOTSTRAP = r"""
import ctypes, resource, runpy, sys
memory, seconds, file_bytes, isolate = (int(value) for value in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
if isolate:
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        sys.stderr.write("ember: cannot isolate the network: unshare failed (errno %d)\n" % ctypes.get_errno())
        sys.exit(97)
sys.argv = sys.argv[5:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_ISOLATION_FAILED = 97
_OUTPUT_READ_CHARS = 65536  # the agent loop cuts the response to max_tool_response_length afterwards


class PythonCodeTool(BaseTool):
    """Runs the `code` argument with Python; see the module docstring for the limits."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.timeout = float(config.get("timeout", 10))
        self.memory_mb = int(config.get("memory_mb", 512))
        self.max_file_mb = int(config.get("max_file_mb", 16))
        self.isolate_network = bool(config.get("isolate_network", True))
        if self.isolate_network:
            result = run_python("pass", self._limits())
            if result.returncode != 0:
                raise UserError(f"tool {self.name}: the code runner cannot isolate the network here "
                                f"({result.stderr.strip() or 'exit ' + str(result.returncode)}); set "
                                "isolate_network: false in its config to run code with network access")

    def _limits(self) -> dict[str, Any]:
        return dict(timeout=self.timeout, memory_mb=self.memory_mb, max_file_mb=self.max_file_mb,
                    isolate_network=self.isolate_network)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str):
            return ToolResponse(text="Error: give the Python source as the string argument 'code'"), 0.0, {}
        result = await asyncio.to_thread(run_python, code, self._limits())
        if result.returncode < 0:
            name = signal.Signals(-result.returncode).name
            raise RuntimeError(f"the code was killed by {name} (CPU limit {self.timeout:g} s, files "
                               f"{self.max_file_mb} MiB)")
        text = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
        if result.returncode:
            text += f"\n(exit code {result.returncode})"
        return ToolResponse(text=text), 0.0, {}


def run_python(code: str, limits: dict[str, Any]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter under `limits` (timeout, memory_mb, max_file_mb, isolate_network);
    raises TimeoutError after killing its process group at the timeout."""
    with tempfile.TemporaryDirectory(prefix="ember-code-") as folder:
        script = Path(folder, "main.py")
        script.write_text(code)
        limit_args = [str(limits["memory_mb"] << 20), str(max(1, int(limits["timeout"] + 0.999))),
                      str(limits["max_file_mb"] << 20), str(int(limits["isolate_network"]))]
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": folder}
        with open(Path(folder, ".stdout"), "w+") as stdout, open(Path(folder, ".stderr"), "w+") as stderr:
            process = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, *limit_args, str(script)],
                                       cwd=folder, env=environment, stdin=subprocess.DEVNULL, stdout=stdout,
                                       stderr=stderr, start_new_session=True)
            try:
                returncode = process.wait(timeout=limits["timeout"])
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise TimeoutError(f"the code ran past the time limit of {limits['timeout']:g} s and was killed") \
                    from None
            stdout.seek(0)
            stderr.seek(0)
            return subprocess.CompletedProcess(process.args, returncode, stdout.read(_OUTPUT_READ_CHARS),
                                               stderr.read(_OUTPUT_READ_CHARS))
