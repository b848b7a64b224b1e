"""Every process a worker started, found and killed, however it detached. Standard library only.

A reward function may start programs that leave the worker's process group and session: a daemon
(`setsid`, a double fork) is out of `killpg`'s reach, and, orphaned, it is re-parented to init and
lives on after the run, holding whatever it inherited (the pipe of `rlloom train ... | cat`).
So a worker makes itself a child subreaper (Linux's `prctl(PR_SET_CHILD_SUBREAPER)`): orphans
below it are re-parented to the worker instead of init, and its whole tree stays below it while
it lives. `kill_tree` freezes that tree with SIGSTOP (a stopped process cannot fork), scanning
/proc until no new process turns up, then SIGKILLs it. No root, cgroup or PID namespace needed.

Orphans that exit while the worker lives stay zombies (a process-table entry each) until the worker
is killed: reaping them in the worker could take the exit status a reward function waits for.
Elsewhere than Linux, only the worker's process group is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_PROC = Path("/proc")


def become_subreaper() -> None:
    """Make orphaned descendants of this process its children (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> set[int]:
    """The processes below `root` in the process tree (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit():
            continue
        try:
            stat = (_PROC / entry.name / "stat").read_bytes()
        except OSError:  # it exited while we looked
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # after "pid (comm) state"; comm may hold ")"
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(root: int) -> None:
    """SIGKILL every process below `root`, then `root`'s process group (`root` with it: it leads one).
    `root` may be this process (a worker ending itself): it is then killed last and never stopped."""
    frozen = {root}
    if root != os.getpid():
        _send(root, signal.SIGSTOP)
    if _PROC.is_dir():
        while new := descendants(root) - frozen:
            for pid in new:
                _send(pid, signal.SIGSTOP)
            frozen |= new
    for pid in frozen - {root}:
        _send(pid, signal.SIGKILL)
    try:
        os.killpg(root, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty already
        _send(root, signal.SIGKILL)


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already (or its pid taken by another user's)
        pass
