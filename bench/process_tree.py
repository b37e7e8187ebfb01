"""CPU seconds of a process tree, read from /proc (Linux): a process and all its live descendants, each with its role
(its Ray worker title, e.g. `ServeReplica:fishgate:Gateway`, or its program), and what each role spent between two
readings. A process counts its own user+system time and that of the children it reaped (cutime+cstime), so a worker
that exited between two readings still counts if its parent is in the tree. Used by bench.ray_cost (and its /proc reading by bench.serving); no fishgate imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

APP = "fishgate"  # the Ray Serve application whose replicas' titles are shortened to "replica NAME"
# Ray's own processes (an argument naming its program → the role) and bench.ray_cost's children (a flag → the role)
RAY_PROGRAMS = (("gcs_server", "gcs_server"), ("raylet", "raylet"), ("log_monitor", "log_monitor"),
                ("dashboard/agent", "dashboard agent"), ("runtime_env/agent", "runtime_env agent"),
                ("autoscaler/_private/monitor", "autoscaler monitor"))  # fmt: skip
BENCH_CHILDREN = (("--ray-child", "driver (serve.run)"), ("--link-child", "fishgate serve --engine"))


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command's ")": state ppid pgrp session … utime (12th) stime cutime cstime,
    times in clock ticks (os.sysconf("SC_CLK_TCK")); None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children) from /proc/PID/stat; None if gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def role_of(pid: int) -> str:
    """A process's role from its command line: Ray's worker titles (`ray::ServeReplica:fishgate:Gateway`), else
    the program's name."""
    try:
        argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    head = argv[0]
    if head.startswith("ray::"):
        title = head.split()[0].removeprefix("ray::").split(".")[0]  # without the task it runs now (".method")
        return title.replace(f"ServeReplica:{APP}:", "replica ")
    for program, role in RAY_PROGRAMS:
        if any(program in arg for arg in argv):
            return role
    for flag, role in BENCH_CHILDREN:
        if flag in argv:
            return role
    if "--alone-child" in argv:
        return "fishgate engine" if "engine" in argv else "fishgate serve"
    return Path(head).name


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid → (role, CPU seconds) of `root` and every live descendant (Linux /proc)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := process_cpu(int(entry.name))) is not None:
            parent[int(entry.name)], cpu[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[str, float]] = {}
    todo = [root] if root in cpu else []
    while todo:
        pid = todo.pop()
        out[pid] = (role_of(pid), cpu[pid])
        todo += children.get(pid, [])
    return out


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, Any]:
    """Seconds each role spent between two readings (a process that started meanwhile counts whole; one that ended
    counts only through the parent that reaped it)."""
    by_role: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        by_role[role] = by_role.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    ranked = sorted(by_role.items(), key=lambda kv: -kv[1])
    return {"cpu_s": round(sum(by_role.values()), 2), "processes": len(after),
            "by_role": {k: round(v, 2) for k, v in ranked}}  # fmt: skip
