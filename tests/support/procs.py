"""Stopping a process a test started (by its Popen handle, so by PID): SIGTERM, then SIGKILL when
it does not exit within five seconds; its stderr pipe, if any, is closed."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    if proc.stderr:
        proc.stderr.close()
