"""Landlock confinement of a local sandbox's commands: nothing outside one directory is writable.

Why it exists: the local sandbox (lockstep.sandbox.local) runs the model's shell commands on the
machine that trains it. Landlock (Linux >= 5.13, unprivileged, no root or container runtime needed)
lets a process give up rights for itself and its children before it executes the command: here every
way of changing the filesystem (write, truncate, create, remove, rename, link) is allowed only under the
episode's directory (and writing to /dev/null), reading stays allowed; with egress denied, TCP connect
and bind are refused (Landlock ABI >= 4; UDP is not covered); and the command may not signal or reach
abstract sockets of processes outside its domain (ABI >= 6), so it cannot kill the trainer.

How: `Confinement.prepare(dir, ...)` builds the ruleset attributes in the parent; `apply()` runs in
the forked child (subprocess's preexec_fn) and only makes the three system calls plus
prctl(PR_SET_NO_NEW_PRIVS), with no Python allocation that could deadlock after fork.

Who calls it: lockstep.sandbox.local. `abi_version()` tells whether the kernel has Landlock.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

_SYS_CREATE_RULESET = 444  # the same numbers on x86_64 and arm64 (the unified syscall table)
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Filesystem rights (linux/landlock.h).
_FS_WRITE_FILE = 1 << 1
_FS_REMOVE_DIR = 1 << 4
_FS_REMOVE_FILE = 1 << 5
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_DIR = 1 << 7
_FS_MAKE_REG = 1 << 8
_FS_MAKE_SOCK = 1 << 9
_FS_MAKE_FIFO = 1 << 10
_FS_MAKE_BLOCK = 1 << 11
_FS_MAKE_SYM = 1 << 12
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1

_WRITES_V1 = (
    _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE_CHAR | _FS_MAKE_DIR | _FS_MAKE_REG
    | _FS_MAKE_SOCK | _FS_MAKE_FIFO | _FS_MAKE_BLOCK | _FS_MAKE_SYM
)  # fmt: skip


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_prctl = _libc.prctl


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    r = _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(r) if r > 0 else 0


@dataclass(slots=True)
class Confinement:
    """Prepared rules for one command: apply() in the child, close() in the parent afterwards."""

    abi: int
    """The Landlock ABI the rules were built for."""
    attr: _RulesetAttr
    """What the ruleset handles (denies unless a rule allows)."""
    size: int
    """sizeof the attribute struct this ABI knows."""
    rules: list[tuple[_PathBeneathAttr, int]]
    """(rule, its O_PATH fd) for the writable directory and /dev/null."""

    @classmethod
    def prepare(cls, writable_dir: str, *, deny_tcp: bool) -> Confinement:
        """Rules letting commands change only `writable_dir` (and write /dev/null); with `deny_tcp`, no
        TCP connect or bind. Raises OSError when the kernel has no Landlock."""
        abi = abi_version()
        if abi < 1:
            raise OSError(
                "Landlock is not available in this kernel (Linux >= 5.13 with landlock in its LSMs)"
            )
        fs = _WRITES_V1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
        net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if deny_tcp and abi >= 4 else 0
        scoped = (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0
        attr = _RulesetAttr(fs, net, scoped)
        size = 8 if abi < 4 else (16 if abi < 6 else 24)
        rules = []
        dir_fd = os.open(writable_dir, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
        rules.append((_PathBeneathAttr(fs, dir_fd), dir_fd))
        null_fd = os.open("/dev/null", os.O_PATH | os.O_CLOEXEC)
        file_rights = _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
        rules.append((_PathBeneathAttr(file_rights, null_fd), null_fd))
        return cls(abi, attr, size, rules)

    def apply(self) -> None:
        """In the child, before exec: no new privileges, then the ruleset on this process for good.
        Raises OSError (the child then fails to start, which the parent reports)."""
        if _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        ruleset = _syscall(_SYS_CREATE_RULESET, ctypes.byref(self.attr), ctypes.c_size_t(self.size), 0)
        if ruleset < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
        for rule, _fd in self.rules:
            if _syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                raise OSError(ctypes.get_errno(), "landlock_add_rule")
        if _syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
        os.close(ruleset)

    def close(self) -> None:
        """Close the rule fds in the parent (the child inherited none: they are close-on-exec)."""
        for _rule, fd in self.rules:
            os.close(fd)
        self.rules.clear()
