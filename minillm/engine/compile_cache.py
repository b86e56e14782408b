"""Compiled decode steps kept on disk, so that a process compiles a step once and later processes load it (chapter 02).

AOTInductor turns the CPU's decode step into a package, a file: a shared library of C++ loops and library calls
plus what it needs to run (`torch._inductor.aoti_compile_and_package`). Compiling it takes tens of seconds;
loading it, a fraction of one. So `CompiledStep` keeps each package in a folder of this cache, named by a digest
of everything that decides what was compiled:

- the step's structure: the name, dtype, shape and strides of every weight and buffer (not their values: the
  package is compiled without its constants, and the step is given the model's own tensors when it is loaded),
  and its example inputs and which of their sizes may change (the layout of the KV pools, the batch class);
- how it was compiled: Inductor's settings, the thread count its loops were built for, the CPU's vector
  instructions (`torch.backends.cpu.get_cpu_capability()`) and model name, the torch version;
- the code it was traced from: a digest of minillm's own source files, so that an edit to the model compiles
  afresh instead of loading a step of the old code.

An entry is a folder `<digest>/` holding `step.pt2` and `entry.json` (the description above, the package's
SHA-256, the compile's seconds). It is written under a temporary name and renamed into place when complete, so
that a process killed mid-write leaves no half entry. Before a package is used, its SHA-256 is checked and it is
loaded and given the step's tensors; if any of that fails (a truncated or altered file, an entry of another
layout), the entry is removed and the step compiled again, with a warning.

The folder: `$MINILLM_COMPILE_CACHE`, else `$XDG_CACHE_HOME/minillm/compiled` (`~/.cache/minillm/compiled`);
`MINILLM_COMPILE_CACHE=off` turns the cache off. `minillm compile MODEL` fills it ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("minillm")

CACHE_ENV = "MINILLM_COMPILE_CACHE"
PACKAGE, ENTRY = "step.pt2", "entry.json"
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # a loaded step: [inputs] -> [outputs]


def cache_root() -> Path | None:
    """The cache's folder (not created here), or None when `MINILLM_COMPILE_CACHE=off`."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minillm" / "compiled"


@functools.cache
def source_digest() -> str:
    """SHA-256 of minillm's own Python files (names and contents), the book's tooling left out: the code a
    compiled step was traced from."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith("book/"):
            continue
        digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def cpu_info(field: str) -> str:
    """A field of /proc/cpuinfo's first processor ("model name", "vendor_id"), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), else the platform's processor string."""
    return cpu_info("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", ... (from /proc/cpuinfo), or "" where it is not known."""
    return cpu_info("vendor_id")


def describe_step(module: torch.nn.Module, inputs: list[Any], configs: dict[str, Any]) -> dict[str, Any]:
    """What decides a compiled step, as JSON-able values: see the module's docstring. `inputs`: the caller's
    description of the step's inputs (each one's dtype, shape and strides, the sizes that may change named as such:
    `minillm.engine.compiled_step.describe_inputs`)."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {
        "tensors": [[name, str(t.dtype), list(t.shape), list(t.stride())] for name, t in tensors],
        "inputs": inputs,
        "inductor_configs": {key: repr(value) for key, value in sorted(configs.items())},
        "threads": torch.get_num_threads(),
        "cpu": [torch.backends.cpu.get_cpu_capability(), cpu_model(), platform.machine()],
        "torch": torch.__version__,
        "minillm_source": source_digest(),
    }


def entry_name(description: dict[str, Any]) -> str:
    """The entry's folder name: the first 32 hex digits of the description's SHA-256."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bind(package: Path, module: torch.nn.Module) -> Runner:
    """Load the package at `package` and give it `module`'s own tensors as its constants (used in place: the step
    reads the module's tensors). Raises if the package cannot be loaded or wants tensors the module lacks.

    Through PyTorch's C++ loader itself (`torch._C._aoti.AOTIModelPackageLoader`, what `aoti_load_package` wraps):
    that takes milliseconds, where the wrapper first imports Inductor and the compiler front end, 2.5 s of a
    cache hit on this book's CPU. Where this PyTorch's loader takes other arguments, the wrapper is used."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))

    def constants(wanted: list[str]) -> dict[str, torch.Tensor]:
        missing = [name for name in wanted if name not in tensors]
        if missing:
            raise ValueError(f"the package wants tensors the step does not have: {missing[:3]}")
        return {name: tensors[name] for name in wanted}

    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        # (constants, use_inactive, check_full_update, user_managed: the step reads our tensors, not copies)
        loader.load_constants(constants(loader.get_constant_fqns()), False, True, True)
    except (AttributeError, TypeError):  # another PyTorch's loader
        loader = torch._inductor.aoti_load_package(str(package))
        loader.load_constants(constants(loader.get_constant_fqns()), check_full_update=True, user_managed=True)
        loader = loader.loader
    return loader.boxed_run  # [tensors] -> [outputs]; empties the list it is given


def load_entry(root: Path, name: str, module: torch.nn.Module, description: dict[str, Any]) -> Runner | None:
    """The cached step `name`, checked and bound to `module`; None if there is none. An entry that fails a check
    (its description, its package's SHA-256, loading it) is removed, with a warning, and None returned."""
    folder = root / name
    if not folder.is_dir():
        return None
    try:
        entry = json.loads((folder / ENTRY).read_text())
        if entry.get("description") != description:
            raise ValueError("its description is not this step's")
        if file_sha256(folder / PACKAGE) != entry.get("sha256"):
            raise ValueError(f"{PACKAGE} does not have the SHA-256 its entry records (truncated or altered)")
        return bind(folder / PACKAGE, module)
    except Exception as error:  # noqa: BLE001 - whatever is wrong with it, the entry is not used
        log.warning("compiled step %s is unusable (%s): removed, compiling it again", folder, error)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def store_entry(root: Path, name: str, package: Path, description: dict[str, Any], seconds: float) -> None:
    """Put the compiled `package` in the cache as entry `name`, atomically (a folder renamed into place). If
    another process stored the same entry meanwhile, theirs is kept. An unwritable cache only logs a warning."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        shutil.copyfile(package, staging / PACKAGE)
        entry = {"description": description, "sha256": file_sha256(staging / PACKAGE),
                 "compile_s": round(seconds, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (staging / ENTRY).write_text(json.dumps(entry, indent=1))
        try:
            os.rename(staging, root / name)
        except OSError:  # the entry exists already (another process compiled the same step): keep that one
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        log.warning("could not keep the compiled step in %s (%s): later processes will compile it again; set "
                    "MINILLM_COMPILE_CACHE to a folder you can write to", root, error)
