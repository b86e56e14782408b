"""A seccomp filter for the grader's sandbox: the system calls a notebook is refused at the kernel (all chapters).

The sandbox caps a notebook's memory with `RLIMIT_AS`, its address space. Memory can be held outside it:
`memfd_create` makes an anonymous file in RAM, and writing to it (without ever mapping it) takes memory no
address-space limit sees, 256 MiB a file (`RLIMIT_FSIZE`) times 256 open files. An exercise has no use for
it, so the sandbox refuses it: bubblewrap loads this filter (`bwrap --seccomp FD`) before it starts Python,
and `os.memfd_create` then fails with EPERM, from Python, ctypes or any library alike.

The filter is a classic BPF program over `struct seccomp_data` (linux/seccomp.h): load the architecture,
load the system call's number, return EPERM for a refused one, allow everything else. The numbers are the
kernel's own tables (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h); an
architecture missing here is allowed everything (the note in `refused_on`).
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF instruction classes and fields (linux/filter.h, linux/bpf_common.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of seccomp_data at offset k
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K: if A == k, skip jt instructions, else skip jf
_RET_K = 0x06  # BPF_RET | BPF_K: return k
_NR, _ARCH = 0, 4  # offsets in seccomp_data
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000

X32_BIT = 0x40000000  # x86_64's x32 ABI numbers its calls from here
# architecture (AUDIT_ARCH_*) -> the refused calls' numbers there
REFUSED = {
    0xC000003E: {"memfd_create": (319, X32_BIT | 319)},  # x86_64
    0xC00000B7: {"memfd_create": (279,)},  # aarch64
}
_MACHINES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, in the machine's byte order


def program() -> bytes:
    """The filter as bytes: for each architecture, `if arch == A: for each refused nr: if nr == n: EPERM`, then
    allow. Every jump goes forward: to the next architecture's block, or to the final two instructions (ALLOW,
    then EPERM); a call no block refuses falls through to ALLOW."""
    body: list[tuple[int, int, int | str, int | str]] = []  # (code, k, jt, jf), jumps by label
    for arch, calls in REFUSED.items():
        numbers = [n for ns in calls.values() for n in ns]
        body.append((_LD_W_ABS, _ARCH, 0, 0))
        body.append((_JEQ_K, arch, 0, f"next:{arch}"))
        body.append((_LD_W_ABS, _NR, 0, 0))
        body += [(_JEQ_K, n, "deny", 0) for n in numbers]
        body.append(("label", f"next:{arch}", 0, 0))  # type: ignore[arg-type]
    code: list[tuple[int, int, int | str, int | str]] = []
    labels: dict[str, int] = {}
    for insn in body:
        if insn[0] == "label":
            labels[str(insn[1])] = len(code)
        else:
            code.append(insn)
    labels["allow"], labels["deny"] = len(code), len(code) + 1  # what falls through the blocks is allowed
    out = bytearray()
    for i, (op, k, jt, jf) in enumerate(code):
        to = [labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        out += _insn(op, k, *to)
    out += _insn(_RET_K, RET_ALLOW)
    out += _insn(_RET_K, RET_ERRNO | errno.EPERM)
    return bytes(out)


def refused_on(machine: str | None = None) -> str:
    """What this machine's sandbox refuses, in words (for the grader's notes and README)."""
    arch = _MACHINES.get(machine or platform.machine())
    if arch is None:
        return f"nothing: no system-call numbers for {machine or platform.machine()} here (memfd_create allowed)"
    return ", ".join(REFUSED[arch])
